"""The prefix cache on a GPU (skipped without CUDA; the GPU script's `packed_unit` step runs
it): the prefixed forward's CUDA branch (fla's delta rule from initial states in rounds,
bfloat16 keys, values and hidden states) against the plain eager forward, through the start-up
probe, through a fan-out of question sets about one state and through a media agent. On CPU the
same logic is covered by tests/test_prefix_cache.py and tests/test_prefix_cache_media.py, and
fla's kernels by tests/test_prefix_fla_interpreter.py."""

from __future__ import annotations

import json
from pathlib import Path

from clef_worker.assembly import assemble_snapshot
from clef_worker.starting import prefix_probe as prefix_check
from clef_worker.starting.check_probes import PROBES
from clef_worker.starting.self_check import BOUNDS, run_self_check
from tests.ci_policy import requires_cuda

pytestmark = requires_cuda()  # the one skip CI allows (tests/ci_policy.py)


def test_the_prefix_probe_passes_on_cuda(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cuda")
    executor.warm_up()
    verdict = run_self_check(executor, "report", PROBES)
    cache = executor.runner.prefix_cache
    assert verdict is not None and cache is not None
    [probe] = [probe for probe in verdict.probes if probe["name"] == prefix_check.PROBE_NAME]
    assert probe["passed"] and probe["reused_tokens"] > 0, probe
    assert probe["max_abs_diff"] <= BOUNDS["bfloat16"]
    assert cache.enabled


def test_a_cuda_fan_out_reuses_the_state_and_answers_as_uncached(tiny_snapshot: Path) -> None:
    on = assemble_snapshot(tiny_snapshot, device="cuda")
    off = assemble_snapshot(tiny_snapshot, device="cuda", prefix_cache="off")
    state = {"events": [{"n": i, "note": f"invoice {i * 37} paid by {i % 11}"}
                        for i in range(30)]}
    for k in range(3):
        body = json.dumps({"model": "clef-flash", "state": state, "questions": {
            f"q{k}": {"type": "choice", "criteria": {"a": "approve", "b": f"block {k}"}}}}
                          ).encode()
        got, want = on.answer(body), off.answer(body)
        assert got.prefix is not None and (got.prefix.reused_tokens > 0) == (k > 0)
        a = json.loads(got.body)["answers"][f"q{k}"]["probabilities"]
        b = json.loads(want.body)["answers"][f"q{k}"]["probabilities"]
        assert max(abs(a[o] - b[o]) for o in a) <= BOUNDS["bfloat16"] + 1e-4


def test_a_cuda_media_agent_reuses_past_the_picture_and_answers_as_uncached(
        tiny_snapshot: Path) -> None:
    """A media request from nothing through the prefixed forward (tower embeddings, 3D
    positions, fla's rounds), then its grown state reusing past the picture."""
    from clef_protocol.media import gradient_image, png_data_uri

    on = assemble_snapshot(tiny_snapshot, device="cuda")
    off = assemble_snapshot(tiny_snapshot, device="cuda", prefix_cache="off")
    picture = png_data_uri(gradient_image(256, 256))
    for turn, events in enumerate((30, 36)):
        state = {"events": [{"n": i, "note": f"invoice {i * 37} paid by {i % 11}"}
                            for i in range(events)]}
        body = json.dumps({"model": "clef-flash", "state": state, "images": [picture],
                           "questions": {"q": {"type": "choice", "criteria": {
                               "a": "approve", "b": "block"}}}}).encode()
        got, want = on.answer(body), off.answer(body)
        assert got.prefix is not None and (got.prefix.reused_tokens > 0) == (turn > 0)
        a = json.loads(got.body)["answers"]["q"]["probabilities"]
        b = json.loads(want.body)["answers"]["q"]["probabilities"]
        assert max(abs(a[o] - b[o]) for o in a) <= BOUNDS["bfloat16"] + 1e-4

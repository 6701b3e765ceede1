"""The worker's prefix cache: a cached prefix plus its suffix equals the whole forward (per layer
kind, then the whole stack and the head), a variant never reuses the base's states, eviction by
bytes, a cached prefix inside a packed group beside uncached requests, and the start-up probe
turning the cache off when it disagrees."""

from __future__ import annotations

import argparse
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchlib.paths import FINETUNE_FIXTURES
from clef_protocol.finetune import resolve_finetunes
from clef_protocol.messages import SelfCheck
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import StartupError
from clef_worker.model import gated_delta, prefix_forward
from clef_worker.model.prefix_forward import (
    Captured,
    PrefixState,
    SequencePlan,
    prefixed_forward,
    torch_delta_rule,
)
from clef_worker.native import NativeExecutor
from clef_worker.serving.prefix.cache import CacheKey, Hit, PrefixCache, ids_array, root_key
from clef_worker.starting import prefix_probe as prefix_check
from clef_worker.starting import verdict_store
from clef_worker.starting.check_probes import PROBES
from clef_worker.starting.self_check import run_self_check
from tests.doubles import break_suffix_positions
from tests.prefix_helpers import agent_loop, events, uncached_probabilities

# Every answer within the golden bound of the uncached forward (fp32 on CPU).
BOUND = 1.5e-4


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    """The worker's defaults on CPU (prefix cache on)."""
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")


def _ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 500, (count,), generator=torch.Generator().manual_seed(seed))


def _prefix_from(captured: Captured, point: int) -> PrefixState:
    """The states a suffix after `point` (the first captured point) starts from."""
    at = captured.points.index(point)
    return PrefixState(point, captured.recurrent[at], captured.conv[at],
                       [k[:, :point] for k in captured.keys],
                       [v[:, :point] for v in captured.values])


# -- per layer kind ----------------------------------------------------------------------------


def _layers(executor: NativeExecutor, kind: str) -> Any:
    return next(layer for layer in executor.backbone.model.layers if layer.block_type == kind)


@torch.inference_mode()
def test_a_gated_deltanet_layer_continues_from_its_cached_states(executor: NativeExecutor) -> None:
    """The recurrent state and the convolution tail at a point, handed to the suffix, give the
    whole sequence's outputs for the suffix's tokens."""
    mixer = _layers(executor, "linear_attention").linear_attn
    x = torch.randn(1, 300, executor.backbone.hidden_size,
                    generator=torch.Generator().manual_seed(1))
    whole_record = Captured((128,), [[]], [[]])
    whole = prefix_forward.gated_delta_net(mixer, x, [SequencePlan(300, None, (128,))],
                                           [(0, 300)], 0, torch_delta_rule, [whole_record])
    prefix = PrefixState(128, whole_record.recurrent[0], whole_record.conv[0], [], [])
    suffix = prefix_forward.gated_delta_net(mixer, x[:, 128:], [SequencePlan(172, prefix)],
                                            [(0, 172)], 0, torch_delta_rule, [Captured(())])
    assert whole_record.conv[0][0].shape[0] == mixer.conv1d.weight.shape[-1] - 1
    torch.testing.assert_close(suffix, whole[:, 128:], atol=1e-5, rtol=1e-5)
    # Without the states the suffix is a different sequence: the test can fail.
    alone = prefix_forward.gated_delta_net(mixer, x[:, 128:], [SequencePlan(172)], [(0, 172)], 0,
                                           torch_delta_rule, [Captured(())])
    assert (alone - whole[:, 128:]).abs().max() > 1e-3


@torch.inference_mode()
def test_an_attention_layer_continues_over_cached_keys_and_values(
        executor: NativeExecutor) -> None:
    """Cached keys/values (after RoPE) plus the new tokens at continued positions give the
    whole sequence's attention outputs for the new tokens."""
    layer = _layers(executor, "full_attention")
    model = executor.backbone.model
    x = torch.randn(1, 300, executor.backbone.hidden_size,
                    generator=torch.Generator().manual_seed(2))
    rotary = model.rotary_emb(x, torch.arange(300).unsqueeze(0))
    record = Captured((128,), [[]], [[]])
    whole = prefix_forward.full_attention(layer.self_attn, x, rotary,
                                          [SequencePlan(300, None, (128,))], [(0, 300)], 0,
                                          [record])
    prefix = PrefixState(128, [], [], [record.keys[0][:, :128]], [record.values[0][:, :128]])
    later = tuple(t[:, 128:] for t in rotary)
    suffix = prefix_forward.full_attention(layer.self_attn, x[:, 128:], later,
                                           [SequencePlan(172, prefix)], [(0, 172)], 0,
                                           [Captured(())])
    torch.testing.assert_close(suffix, whole[:, 128:], atol=1e-5, rtol=1e-5)


def test_the_scan_hands_out_the_states_a_split_call_ends_with() -> None:
    """`checkpoints` give the state after those tokens: the final state of a call over just
    them (the chunk-aligned point and the unaligned end)."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 100, 1, 16, generator=gen) for _ in range(2))
    v = torch.randn(1, 100, 2, 16, generator=gen)
    g = -torch.rand(1, 100, 2, generator=gen)
    beta = torch.rand(1, 100, 2, generator=gen)
    _, states = gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=32,
                                                     checkpoints=(64, 100))
    assert states is not None
    for index, at in enumerate((64, 100)):
        _, final = gated_delta.chunked_gated_delta_rule(
            q[:, :at], k[:, :at], v[:, :at], g[:, :at], beta[:, :at], chunk_size=32,
            output_final_state=True)
        assert final is not None
        torch.testing.assert_close(states[index], final, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="checkpoint 50"):
        gated_delta.chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=32, checkpoints=(50,))


@torch.inference_mode()
def test_the_whole_stack_from_a_cached_prefix_equals_the_whole_forward(
        executor: NativeExecutor) -> None:
    backbone = executor.backbone
    ids = _ids(700, 4)
    whole = backbone.hidden_states(ids)
    _, captured = prefixed_forward(backbone.model, ids[:512],
                                   [SequencePlan(512, None, (256, 512))], torch_delta_rule)
    for point in (256, 512):
        prefix = _prefix_from(captured[0], point) if point == 256 else PrefixState(
            512, captured[0].recurrent[1], captured[0].conv[1], captured[0].keys,
            captured[0].values)
        suffix, _ = prefixed_forward(backbone.model, ids[point:],
                                     [SequencePlan(700 - point, prefix)], torch_delta_rule)
        torch.testing.assert_close(suffix, whole[point:], atol=1e-4, rtol=1e-4)


# -- the cache itself ----------------------------------------------------------------------


def _captured(points: tuple[int, ...], start: int, end: int, width: int = 8) -> Captured:
    """A forward's capture with small tensors (one layer of each kind)."""
    new = end - start
    return Captured(points, [[torch.zeros(2, 4, 4)] for _ in points],
                    [[torch.zeros(3, width)] for _ in points],
                    [torch.zeros(1, new, 4)], [torch.zeros(1, new, 4)], [0] * len(points))


def _store(cache: PrefixCache, key: CacheKey, ids: np.ndarray) -> Hit:
    hit = cache.lookup(key, ids)
    points = cache.points(hit.tokens, key.state_end)
    if points:
        cache.store(key, ids, hit, _captured(points, hit.tokens, len(ids)),
                    torch.zeros(len(ids) - hit.tokens, 8))
    return hit


def test_blocks_are_stored_at_block_ends_and_the_state_end_and_found_again() -> None:
    cache = PrefixCache(1 << 30)
    root = root_key("0:")
    ids = ids_array(range(1000))
    assert cache.points(0, 700) == (256, 512, 640)
    # A state ending on a multiple of 64 keeps its last tokens out (they change as it grows).
    assert cache.points(0, 704) == (256, 512, 640)
    assert cache.points(512, 1120) == (768, 1024, 1088)
    assert _store(cache, CacheKey(root, 700), ids).tokens == 0
    assert len(cache.blocks) == 3
    # The same state asked again: all of it (to the rounded state end) is reused.
    again = cache.lookup(CacheKey(root, 700), ids)
    assert again.tokens == 640 and [b.end for b in again.chain] == [256, 512, 640]
    state = again.state()
    assert state is not None and state.keys[0].shape == (1, 640, 4)
    # A state that grew: the previous end (a partial block) is reused, not only full blocks.
    grown = ids_array([*range(690), *range(5000, 5300)])
    assert cache.lookup(CacheKey(root, 950), grown).tokens == 640
    # Other tokens inside the first block: nothing.
    other = ids.copy()
    other[10] = 999
    assert cache.lookup(CacheKey(root, 700), other).tokens == 0
    assert (cache.hits, cache.lookups) == (2, 4)
    assert cache.tokens_reused == 1280


def test_a_variant_root_never_finds_the_bases_blocks() -> None:
    cache = PrefixCache(1 << 30)
    ids = ids_array(range(800))
    _store(cache, CacheKey(root_key("0:"), 700), ids)
    assert cache.lookup(CacheKey(root_key("1:tiny-alpha"), 700), ids).tokens == 0
    assert cache.lookup(CacheKey(root_key("0:"), 700), ids).tokens == 640


def test_eviction_by_bytes_drops_the_least_recent_chain_tail_first() -> None:
    one_chain = PrefixCache(1 << 30)
    _store(one_chain, CacheKey(root_key("0:"), 700), ids_array(range(800)))
    chain_bytes = one_chain.bytes
    assert chain_bytes == sum(block.nbytes for block in one_chain.blocks.values()) > 0
    # Room for two chains of three blocks, not three.
    cache = PrefixCache(2 * chain_bytes + chain_bytes // 2)
    roots = [CacheKey(root_key(f"{n}:"), 700) for n in range(3)]
    ids = ids_array(range(800))
    _store(cache, roots[0], ids)
    _store(cache, roots[1], ids)
    assert cache.lookup(roots[0], ids).tokens == 640  # the first is now the most recent
    _store(cache, roots[2], ids)
    assert cache.bytes <= cache.capacity_bytes
    assert cache.bytes == sum(block.nbytes for block in cache.blocks.values())
    assert cache.lookup(roots[0], ids).tokens == 640
    assert cache.lookup(roots[2], ids).tokens == 640
    # The second chain lost its tail first: its head block may remain, never a tail without
    # its head.
    assert cache.lookup(roots[1], ids).tokens < 640
    for block in cache.blocks.values():
        assert block.parent in cache.blocks or block.parent in {k.root for k in roots}


def test_a_block_evicted_takes_its_descendants() -> None:
    cache = PrefixCache(1 << 30)
    key = CacheKey(root_key("0:"), 700)
    _store(cache, key, ids_array(range(800)))
    head = next(block for block in cache.blocks.values() if block.start == 0)
    cache._drop(head.key)
    assert not cache.blocks and cache.bytes == 0


def test_off_or_zero_bytes_is_disabled_with_a_reason() -> None:
    assert PrefixCache(1 << 20, enabled=False).info().disabled_reason == "--prefix-cache off"
    assert PrefixCache(0).info().enabled is False
    cache = PrefixCache(1 << 20)
    assert cache.lookup(CacheKey(root_key(""), 700), ids_array(range(800))).tokens == 0
    cache.disable("probe disagreed")
    assert cache.info() == cache.info().__class__(False, 1 << 20, 256, "probe disagreed")
    assert cache.points(0, 700) == ()


# -- through the runner and the executor -----------------------------------------------------


def _request(state: Any, questions: dict[str, Any], model: str = "clef-flash") -> bytes:
    return json.dumps({"model": model, "state": state, "questions": questions}).encode()


QUESTIONS = {"decide": {"type": "choice", "criteria": {"a": "approve", "b": "block"}}}
OTHER = {"risky": {"type": "noul"}, "level": {"type": "score", "criteria": ["low", "high"]}}




def test_a_cached_prefix_inside_a_packed_group_beside_uncached_requests(
        executor: NativeExecutor) -> None:
    cache = executor.runner.prefix_cache
    assert cache is not None and cache.enabled  # on by default
    cache.clear()
    warm = executor.prepare(_request(events(16), QUESTIONS))
    executor.answer_prepared([warm])
    group = [executor.prepare(_request(events(16), OTHER)),
             executor.prepare(_request(events(5, "x"), QUESTIONS)),
             executor.prepare(_request(events(9, "y"), OTHER))]
    staged = executor.stage(group)
    output = executor.runner.run_staged(staged[1])
    assert [row.reused_tokens > 0 for row in output.rows] == [True, False, False]
    assert output.rows[0].reused_tokens >= cache.block_tokens
    assert all(row.batch_size == 3 for row in output.rows)
    for prepared, row in zip(group, output.rows, strict=True):
        want = uncached_probabilities(executor, prepared)
        assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND


def test_an_agent_loop_reuses_its_previous_turn_and_answers_as_uncached(
        executor: NativeExecutor) -> None:
    """A state growing turn by turn: each turn reuses up to the previous turn's state end, and
    every answer is the uncached one within the bound; the response frame's `prefix` counts."""
    reused, answer = agent_loop(executor, QUESTIONS, 1e-4 + BOUND)
    assert reused[0] == 0 and 0 < reused[1] < reused[2]
    assert answer.prefix is not None
    assert answer.prefix.tokens_reused >= reused[1] + reused[2]


def test_a_variant_never_reuses_the_bases_states(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                 finetunes=tuple(resolve_finetunes([str(FINETUNE_FIXTURES)])))
    state = events(16)
    [base] = executor.answer_prepared([executor.prepare(_request(state, QUESTIONS))])
    variant = executor.prepare(_request(state, OTHER, model="tiny-alpha"))
    assert variant.slot != 0
    [first] = executor.answer_prepared([variant])
    assert base.prefix is not None and first.prefix is not None
    assert first.prefix.reused_tokens == 0
    [again] = executor.answer_prepared([executor.prepare(_request(state, QUESTIONS,
                                                                  model="tiny-alpha"))])
    assert again.prefix is not None and again.prefix.reused_tokens > 0  # its own states
    got = json.loads(again.body)["answers"]["decide"]["probabilities"]
    want = uncached_probabilities(executor, executor.prepare(_request(state, QUESTIONS,
                                                              model="tiny-alpha")))
    assert max(abs(p - w) for p, w in zip(got.values(), want, strict=True)) <= 1e-4 + BOUND


# -- the start-up probe ------------------------------------------------------------------------


def _checked(executor: NativeExecutor, mode: str = "on") -> tuple[SelfCheck, dict[str, Any]]:
    """The whole start-up self-check in `mode` (the worker's list of probes) and its `prefix`
    probe's record."""
    verdict = run_self_check(executor, mode, PROBES)
    assert verdict is not None
    [probe] = [probe for probe in verdict.probes if probe["name"] == prefix_check.PROBE_NAME]
    return verdict, probe


def test_the_probe_passes_and_leaves_the_cache_on_and_empty(executor: NativeExecutor) -> None:
    cache = executor.runner.prefix_cache
    assert cache is not None
    verdict, probe = _checked(executor)
    # The tiny snapshot has a vision tower: the text pair and a pictured request alone.
    assert verdict.passed and probe["passed"] and probe["checked"] == 3
    assert probe["max_abs_diff"] <= 1e-4 and probe["reused_tokens"] > 0
    assert probe["media_reused_tokens"] > 0
    # The cached tokens' hidden states are compared too, and agree to float32 rounding.
    assert probe["max_hidden_diff"] is not None and probe["max_hidden_diff"] < 1e-4
    assert cache.enabled and not cache.blocks


def test_a_disagreeing_probe_turns_the_cache_off_with_an_error(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")
    break_suffix_positions(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="clef_worker.starting.self_check"):
        verdict, probe = _checked(executor)
    cache = executor.runner.prefix_cache
    assert cache is not None and not probe["passed"] and probe["max_abs_diff"] > 1e-4
    # The layout agreed, so the worker serves it; the remedy is in the verdict, which is
    # therefore never kept (the next start checks again).
    assert verdict.passed and verdict.layout == "per-group"
    assert "prefix cache off" in probe["remedy"]
    assert not verdict_store.keepable(verdict)
    info = cache.info()
    assert not info.enabled and "prefixed probe differs" in info.disabled_reason
    assert any("prefix cache off" in record.getMessage() for record in caplog.records)
    # Off means off: later requests neither reuse nor store.
    [answer] = executor.answer_prepared([executor.prepare(_request(events(16), QUESTIONS))])
    assert answer.prefix is not None and answer.prefix.reused_tokens == 0 and not cache.blocks


def test_report_records_a_disagreeing_probe_and_keeps_the_cache_on(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`--self-check report` (what the GPU benchmarks run): the mismatch is logged, the cache
    stays on, so the benchmark measures the path it asked for."""
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")
    break_suffix_positions(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="clef_worker.starting.self_check"):
        verdict, probe = _checked(executor, "report")
    cache = executor.runner.prefix_cache
    assert cache is not None and not probe["passed"] and "remedy" not in probe
    assert not verdict.passed and verdict.mode == "report"
    assert cache.info().enabled and cache.info().disabled_reason == ""
    assert any("prefix probe" in record.getMessage() and "--self-check report" in
               record.getMessage() for record in caplog.records)


def test_the_probe_checks_the_media_branch_of_the_prefixed_forward(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault only media requests meet (the rotary offset a suffix continues from after a
    picture, zeroed) is caught by the pictured part of the probe, and without a vision tower
    the probe has no pictured part."""
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")
    monkeypatch.setattr(prefix_forward.SequencePlan, "rope_delta", property(lambda plan: 0))
    _, probe = _checked(executor)
    assert not probe["passed"] and probe["media_reused_tokens"] > 0 and "remedy" in probe
    monkeypatch.undo()
    textual = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", media="off")
    _, probe = _checked(textual)
    assert probe["passed"] and probe["checked"] == 2 and probe["media_reused_tokens"] is None


def test_strict_refuses_to_start_on_a_disagreeing_probe(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")
    break_suffix_positions(monkeypatch)
    with pytest.raises(StartupError, match="the prefix probe differs"):
        run_self_check(executor, "strict", PROBES)


# -- the worker process's frames -------------------------------------------------------------


def _worker_frames(snapshot: Path, flags: list[str], bodies: list[bytes]) -> list[dict]:
    """A CPU worker started in this process with these flags: its `ready` frame, then its
    replies to `bodies`, sent one at a time."""
    from clef_protocol import messages
    from clef_protocol.frames import encode_frame, read_frame_blocking
    from clef_worker.main import parse_args, serve, start

    out = io.BytesIO()
    executor = start(parse_args(["--model", str(snapshot), "--device", "cpu", *flags]), out)
    assert executor is not None
    frames = []
    for number, body in enumerate(bodies, 1):
        serve(executor, io.BytesIO(encode_frame(messages.request(number, body))), out,
              executor.policy)
    out.seek(0)
    while (frame := read_frame_blocking(out)) is not None:
        frames.append(frame)
    return frames


def test_ready_and_responses_report_the_cache(tiny_snapshot: Path) -> None:
    """Production defaults: `ready` says the cache is on (the probe passed) with its bound and
    block; the second request about the same state says how many tokens it reused."""
    from clef_protocol import messages

    body = _request(events(16), QUESTIONS)
    ready, first, second = _worker_frames(tiny_snapshot, [], [body, body])
    info = messages.ReadyInfo.from_message(ready).prefix_cache
    assert info == messages.PrefixCacheInfo(True, 1 << 30, 256, "")
    replies = [messages.from_worker(frame) for frame in (first, second)]
    assert all(isinstance(r, messages.WorkerReply) and r.prefix is not None for r in replies)
    stats = [r.prefix for r in replies if isinstance(r, messages.WorkerReply)]
    assert stats[0] is not None and stats[1] is not None
    assert stats[0].reused_tokens == 0 and stats[0].lookups == 1  # the probe's were dropped
    assert stats[1].reused_tokens > 0 and stats[1].hits == 1
    assert stats[1].entries > 0 and stats[1].bytes > 0


def test_prefix_cache_off_is_reported_and_reuses_nothing(tiny_snapshot: Path) -> None:
    from clef_protocol import messages

    body = _request(events(16), QUESTIONS)
    ready, _, second = _worker_frames(
        tiny_snapshot, ["--prefix-cache", "off", "--prefix-cache-bytes", "4096"], [body, body])
    info = messages.ReadyInfo.from_message(ready).prefix_cache
    assert info == messages.PrefixCacheInfo(False, 4096, 256, "--prefix-cache off")
    reply = messages.from_worker(second)
    assert isinstance(reply, messages.WorkerReply) and reply.prefix is not None
    assert (reply.prefix.reused_tokens, reply.prefix.lookups, reply.prefix.entries) == (0, 0, 0)


def test_zero_bytes_turns_the_cache_off_and_auto_is_by_device(tiny_snapshot: Path) -> None:
    """`--prefix-cache-bytes 0` is a bound of no bytes: the cache is off, for the reason the
    operator gave (not the self-check's, so no alert); left out (`auto`) it is the device's
    default bound."""
    from clef_protocol import messages
    from clef_protocol.options import (
        DEFAULT_PREFIX_CACHE_BYTES_CPU,
        add_model_arguments,
        prefix_cache_capacity,
        worker_argv,
    )

    body = _request(events(16), QUESTIONS)
    ready, _, second = _worker_frames(tiny_snapshot, ["--prefix-cache-bytes", "0"],
                                      [body, body])
    info = messages.ReadyInfo.from_message(ready).prefix_cache
    assert info == messages.PrefixCacheInfo(False, 0, 256, messages.PREFIX_CACHE_NO_BYTES)
    assert info is not None and not info.turned_off
    reply = messages.from_worker(second)
    assert isinstance(reply, messages.WorkerReply) and reply.prefix is not None
    assert (reply.prefix.reused_tokens, reply.prefix.entries) == (0, 0)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    default = parser.parse_args([])
    assert default.prefix_cache_bytes == "auto"
    assert parser.parse_args(worker_argv(default)).prefix_cache_bytes == "auto"  # as passed on
    assert parser.parse_args(["--prefix-cache-bytes", "0"]).prefix_cache_bytes == 0
    assert prefix_cache_capacity("auto", "cpu") == DEFAULT_PREFIX_CACHE_BYTES_CPU


def test_nothing_is_stored_under_a_chain_evicted_since_the_lookup() -> None:
    """A group's neighbour may evict the chain a request reused before that request stores:
    blocks under it could never be found again, so none are kept."""
    cache = PrefixCache(1 << 30)
    key = CacheKey(root_key("0:"), 700)
    ids = ids_array(range(1000))
    _store(cache, key, ids)
    grown = CacheKey(key.root, 950)
    hit = cache.lookup(grown, ids)
    assert hit.tokens == 640
    cache.clear()
    points = cache.points(hit.tokens, grown.state_end)
    cache.store(grown, ids, hit, _captured(points, hit.tokens, 1000), torch.zeros(360, 8))
    assert not cache.blocks and cache.bytes == 0 and not cache.children


def test_cudas_long_blocks_are_probed_through_a_chain_of_two_points(
        tiny_snapshot: Path) -> None:
    """A CUDA worker's cache (2,048-token blocks) with the probe cut to a block end and the
    state-end point, run here on CPU: the probe reuses both and agrees."""
    from clef_worker.serving.prefix.cache import default_block_tokens

    assert (default_block_tokens("cuda:1"), default_block_tokens("cpu")) == (2048, 256)
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")
    executor.runner.prefix_cache = PrefixCache(1 << 30, block_tokens=default_block_tokens("cuda"))
    stored: list[int] = []
    original = PrefixCache.store

    def counting(self: PrefixCache, *args: Any) -> None:
        original(self, *args)
        stored.append(len(self.blocks))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PrefixCache, "store", counting)
        _, probe = _checked(executor)
    assert probe["passed"] and probe["reused_tokens"] > 0
    assert stored[0] == 2  # the warm request stored a block end and its state-end point

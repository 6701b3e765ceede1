"""The start-up self-check with fine-tuned variants served (`--finetune`): the probe's requests
take the base and each variant in turn (clef_worker.starting.variant_probe), so a serving path that
scores a variant's tokens with the wrong adapter is caught, though every base answer is right.

Workers start in-process through `clef_worker.main.start`, as in tests/test_self_check.py; the
fault is injected with pytest's monkeypatch and exists only inside the test.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from benchlib.golden import answered, assert_response_matches
from benchlib.paths import FINETUNE_FIXTURES, FINETUNE_REFERENCE
from clef_protocol import messages
from clef_worker.native import NativeExecutor
from clef_worker.serving import runner as runner_module
from clef_worker.starting.variant_probe import probe_slots, reference_runner
from tests.answer_compare import assert_same_response
from tests.worker_start import start_worker as start_any

FP32_BOUND = 1e-4


def start_worker(snapshot: Path, *flags: str) -> tuple[NativeExecutor | None, dict]:
    """A CPU worker with both fixture variants, started in this process."""
    return start_any(snapshot, "--finetune", str(FINETUNE_FIXTURES), *flags)


@pytest.fixture
def packed_spans_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed row's adapter spans one token late: each variant request's first token takes
    the adapter of the request before it. The backbone, the heads and every base-only forward
    are untouched (a base-only group selects no adapter at all)."""
    real = runner_module._end_to_end

    def late(lengths: Sequence[int]) -> list[tuple[int, int]]:
        total = sum(lengths)
        return [(min(start + 1, total), min(end + 1, total)) for start, end in real(lengths)]

    monkeypatch.setattr(runner_module, "_end_to_end", late)


def test_the_probe_takes_the_base_and_each_variant_in_turn(tiny_snapshot: Path) -> None:
    executor, frame = start_worker(tiny_snapshot, "--self-check", "off")
    assert executor is not None and frame["kind"] == messages.READY
    assert probe_slots(executor.runner, 7) == [0, 1, 2, 0, 1, 2, 0]
    selection = executor.runner.selection
    assert selection is not None
    selection.mode = "stacked"
    with reference_runner(executor.runner) as plain:
        assert selection.mode == "segments" and plain.heads == executor.runner.heads
        assert plain.graphs is None and plain.selection is selection
    assert selection.mode == "stacked"


def test_the_default_passes_with_variants(tiny_snapshot: Path) -> None:
    """Production defaults (self-check on, per-group layout) with variants: the check passes
    on the path it starts with."""
    executor, frame = start_worker(tiny_snapshot)
    assert executor is not None and frame["kind"] == messages.READY
    verdict = frame["self_check"]
    assert verdict["passed"] is True and verdict["fell_back_from"] == []
    assert verdict["layout"] == "per-group" and verdict["max_abs_diff"] <= FP32_BOUND


def test_a_variant_scored_with_the_wrong_adapter_fails_the_check(
        tiny_snapshot: Path, packed_spans_off_by_one: None,
        caplog: pytest.LogCaptureFixture) -> None:
    """Packed adapter spans one token late: the check finds the variant requests wrong, falls
    back to padded rows (one row per request, spans of their own), and every variant then
    answers as the reference on its merged release does, alone and in a mixed group."""
    caplog.set_level(logging.INFO)
    executor, frame = start_worker(tiny_snapshot)
    assert executor is not None
    errors = [r.getMessage() for r in caplog.records
              if r.name == "clef_worker.starting.self_check" and r.levelno == logging.ERROR]
    assert len(errors) == 1 and "the per-group path differs" in errors[0]
    assert frame["self_check"]["fell_back_from"] == ["per-group"]
    assert frame["self_check"]["layout"] == "padded" and frame["self_check"]["passed"] is True
    rows = [json.loads(line) for line in FINETUNE_REFERENCE.read_text().splitlines() if line]
    cases = {c["name"] for c in answered() if c["max_length"] == 16384}
    alpha, beta = ([row for row in rows if row["name"] in cases and row["variant"] == variant]
                   for variant in ("tiny-alpha", "tiny-beta"))
    chosen = [row for pair in zip(alpha[:3], beta[3:6], strict=True) for row in pair]
    bodies = [json.dumps(row["request"]).encode() for row in chosen]
    alone = [executor.answer(body).body for body in bodies]
    for row, body in zip(chosen, alone, strict=True):
        assert_response_matches(json.loads(body), row["response"])
    grouped = executor.answer_prepared([executor.prepare(body) for body in bodies])
    for got, want in zip(grouped, alone, strict=True):
        assert_same_response(got.body, want)


def test_strict_refuses_a_variant_scored_with_the_wrong_adapter(
        tiny_snapshot: Path, packed_spans_off_by_one: None) -> None:
    executor, frame = start_worker(tiny_snapshot, "--self-check", "strict")
    assert executor is None and frame["kind"] == messages.FATAL
    assert "self-check failed (--self-check strict): the per-group path differs" \
        in frame["reason"]


def test_padded_graph_shapes_with_variants_pass(tiny_snapshot: Path) -> None:
    """`--cuda-graphs on --batch-layout padded` (the shapes built on CPU through the code a
    capture records): the probe's mixed groups replay the padded shapes' static slot buffers,
    pad rows included, and agree with the eager answers. A small token budget and bucket
    table (the setting this test is about is the layout) keep the shapes built on CPU few."""
    executor, frame = start_worker(tiny_snapshot, "--cuda-graphs", "on", "--batch-layout",
                                   "padded", "--graph-max-length", "512",
                                   "--max-batch-tokens", "2048", "--max-batch", "4")
    assert executor is not None and frame["kind"] == messages.READY
    verdict = frame["self_check"]
    assert verdict["layout"] == "padded-graphs" and verdict["passed"] is True
    assert verdict["fell_back_from"] == [] and verdict["max_abs_diff"] <= FP32_BOUND
    graphs = executor.runner.graphs
    assert graphs is not None and graphs.selection is not None

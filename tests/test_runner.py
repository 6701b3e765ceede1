"""The model runner over batched graph shapes, on CPU (the static-buffer forwards run eagerly):
a batch padded to a built `[rows, tokens]` shape, pad rows included, answers every request as
it would be answered alone (golden cases and hypothesis-generated requests), and the forward
each request ran in is the one reported. Also: warming every batch size the batcher forms."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchlib.executors import with_limits
from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.backbone import Backbone
from clef_worker.model.encoding import Encoding
from clef_worker.native import NativeExecutor, Scored
from clef_worker.serving.gpu.buckets import BucketTable
from clef_worker.serving.gpu.capture import EagerCapturer
from clef_worker.serving.gpu.graphs import GraphRunner
from clef_worker.serving.runner import ModelRunner, warm_row_counts
from tests.answer_compare import assert_same_response
from tests.conftest import GOLDEN
from tests.request_strategies import requests

CASES = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line]
SHORT = [case for case in CASES if "error" not in case and len(case["input_ids"]) <= 512]
LOGIT_TOLERANCE = 1e-5
# Buckets 256 and 512; batched shapes of 2 and 4 rows at 512 tokens.
SHAPES = [(1, 256), (1, 512), (2, 512), (4, 512)]


@pytest.fixture(scope="module")
def plain(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               limits=RequestLimits(max_length=16384))


@pytest.fixture(scope="module")
def batched(plain: NativeExecutor) -> ModelRunner:
    """The same model behind a graph runner whose batched replays always win the choice."""
    graphs = GraphRunner(plain.backbone, BucketTable((256, 512)), plain.pad_id, EagerCapturer(),
                         SHAPES)
    graphs.build_all()
    graphs.costs_ms = {shape: (1.0 if shape[0] == 1 else 0.5) for shape in SHAPES}
    return ModelRunner(plain.backbone, plain.head, plain.pad_id, None, graphs)


def _encode(executor: NativeExecutor, request: dict[str, Any], max_length: int) -> Encoding:
    return with_limits(executor, dataclasses.replace(executor.limits, max_length=max_length)
                                ).encode(request)


def assert_batch_answers_as_alone(plain: NativeExecutor, runner: ModelRunner,
                                  requests_: list[dict[str, Any]], max_lengths: list[int]) -> None:
    encodings = [_encode(plain, request, limit)
                 for request, limit in zip(requests_, max_lengths, strict=True)]
    assert isinstance(runner.graphs, GraphRunner)
    replays = dict(runner.graphs.stats.replays)
    output = runner.run(encodings)
    padded = runner.graphs.shape_for(len(encodings), max(len(e.input_ids) for e in encodings))
    if padded is not None:  # one replay of the padded shape answered all of them
        assert runner.graphs.stats.replays[padded] == replays.get(padded, 0) + 1
        assert [row.batch_size for row in output.rows] == [len(encodings)] * len(encodings)
    assert set(output.stages) == {"forward_ms", "head_ms"}
    for request, encoding, row in zip(requests_, encodings, output.rows, strict=True):
        alone = plain.runner.run([encoding]).rows[0]
        assert max(abs(a - b) for a, b in zip(row.logits, alone.logits, strict=True)) \
            <= LOGIT_TOLERANCE
        got = Scored(request, encoding, row.logits, row.probabilities).response()
        want = Scored(request, encoding, alone.logits, alone.probabilities).response()
        assert_same_response(json.dumps(got).encode(), json.dumps(want).encode())


def test_golden_cases_padded_to_a_batched_shape_answer_as_alone(
        plain: NativeExecutor, batched: ModelRunner) -> None:
    """Every short golden case once, in batches of 3, 4 and 2: 3 requests pad to the 4-row
    shape, so a pad row rides along and changes nothing."""
    position, sizes = 0, itertools.cycle((3, 4, 2))
    while position < len(SHORT):
        picked = SHORT[position:position + next(sizes)]
        position += len(picked)
        if len(picked) > 1:
            assert_batch_answers_as_alone(plain, batched, [c["request"] for c in picked],
                                          [c["max_length"] for c in picked])


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(requests(), min_size=2, max_size=4))
def test_random_requests_padded_to_a_batched_shape_answer_as_alone(
        plain: NativeExecutor, batched: ModelRunner, batch: list[dict[str, Any]]) -> None:
    admitted = []
    for request in batch:
        try:
            plain.encode(request)
        except RequestInvalid:
            continue
        admitted.append(request)
    if admitted:
        assert_batch_answers_as_alone(plain, batched, admitted, [16384] * len(admitted))


def test_sequential_replays_report_forwards_of_one(plain: NativeExecutor,
                                                   batched: ModelRunner) -> None:
    assert batched.graphs is not None
    costs = dict(batched.graphs.costs_ms)
    batched.graphs.costs_ms = {shape: float(shape[0]) for shape in SHAPES}  # batching loses
    try:
        encodings = [_encode(plain, case["request"], case["max_length"]) for case in SHORT[:3]]
        output = batched.run(encodings)
    finally:
        batched.graphs.costs_ms = costs
    assert [row.batch_size for row in output.rows] == [1, 1, 1]
    for encoding, row in zip(encodings, output.rows, strict=True):
        alone = plain.runner.run([encoding]).rows[0]
        assert max(abs(a - b) for a, b in zip(row.logits, alone.logits, strict=True)) \
            <= LOGIT_TOLERANCE


def test_every_batch_size_is_warmed() -> None:
    """fla tunes its cumulative sum per batch size: each row count gets one layer run."""
    seen: list[tuple[int, ...]] = []

    def mixer(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(hidden.shape))
        return hidden

    model = SimpleNamespace(layers=[SimpleNamespace(), SimpleNamespace(linear_attn=mixer)],
                            config=SimpleNamespace(hidden_size=8))
    backbone = Backbone(model=model, lexical_table=torch.zeros(1), device=torch.device("cpu"),
                        dtype=torch.float32, gdn_path="fla")
    warm_row_counts(backbone, (1, 2, 4, 8, 16), 64)
    assert seen == [(rows, 64, 8) for rows in (1, 2, 4, 8, 16)]

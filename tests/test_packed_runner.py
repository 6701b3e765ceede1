"""Packed batches at the runner and executor level, on CPU: every golden case, in mixed packed
groups, answers as it does alone (C1): every question's argmax equal, every logit and
probability within the golden bound. Both packed forms run: the eager row (the requests' tokens
end to end) and the static row a CUDA graph replays (each request aligned to 64, a dummy tail
filling the total-token bucket, the head reading each request's rows from its offset), built
eagerly here. Also: the shapes the H200 defaults plan, and the batch policy in `ready`."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from benchlib.executors import with_limits
from benchlib.golden import PROBABILITY_TOLERANCE
from clef_protocol import messages
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.encoding import Encoding
from clef_worker.native import NativeExecutor
from clef_worker.serving.batching import answer_groups
from clef_worker.serving.gpu.capture import EagerCapturer
from clef_worker.serving.gpu.packed_graphs import (
    PACK_ALIGN,
    PackedGraphRunner,
    aligned_offsets,
    aligned_total,
    packed_buckets,
)
from clef_worker.serving.policy import PACKED, PADDED, BatchPolicy
from clef_worker.serving.runner import ModelRunner
from tests.answer_compare import assert_same_response
from tests.ci_policy import requires_cuda
from tests.conftest import GOLDEN

CASES = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line]
OK = [case for case in CASES if "error" not in case]
BOUND = PROBABILITY_TOLERANCE  # the golden bound (1e-4)
STATIC_BUCKETS = (512, 1024, 2048, 4096)
BF16_GATE = 1e-2  # the release's bfloat16 gate on probabilities (every argmax equal)


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               limits=RequestLimits(), batch_layout=PACKED)


@pytest.fixture(scope="module")
def encodings(executor: NativeExecutor) -> list[Encoding]:
    return [with_limits(executor, dataclasses.replace(executor.limits,
                                                     max_length=case["max_length"]))
            .encode(case["request"]) for case in OK]


@pytest.fixture(scope="module")
def alone(executor: NativeExecutor, encodings: list[Encoding]) -> list[tuple[list[float],
                                                                             list[float]]]:
    """Each case's C1 values: a padded runner without graphs, one request per forward."""
    runner = ModelRunner(executor.backbone, executor.head, executor.pad_id, layout=PADDED)
    out = []
    for encoding in encodings:
        row = runner.run([encoding]).rows[0]
        out.append((row.logits, row.probabilities))
    return out


@pytest.fixture(scope="module")
def static_runner(executor: NativeExecutor) -> ModelRunner:
    graphs = PackedGraphRunner(executor.backbone, STATIC_BUCKETS, 16, executor.pad_id,
                               EagerCapturer())
    graphs.build_all()
    return ModelRunner(executor.backbone, executor.head, executor.pad_id, graphs=graphs,
                       layout=PACKED)


def _mixed_groups(seed: int, size: int, limit: int) -> list[list[int]]:
    """Every case once, shuffled into groups of up to `size` whose aligned total fits `limit`
    (the long cases then share groups with short ones)."""
    order = list(range(len(OK)))
    random.Random(seed).shuffle(order)
    groups: list[list[int]] = []
    for index in order:
        length = len(OK[index]["input_ids"])
        if groups and len(groups[-1]) < size and \
                aligned_total([len(OK[i]["input_ids"]) for i in groups[-1]] + [length]) <= limit:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _assert_as_alone(encoding: Encoding, got: tuple[list[float], list[float]],
                     want: tuple[list[float], list[float]], bound: float = BOUND) -> None:
    for values, reference in zip(got, want, strict=True):
        assert len(values) == len(reference)
    # probabilities within the bound (logits in float32 the same; in bfloat16 only the argmax)
    assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) <= bound
    if bound == BOUND:
        assert max(abs(a - b) for a, b in zip(got[0], want[0], strict=True)) <= bound
    first = 0
    for question in encoding.questions:
        count = len(question.option_spans)
        logits, reference = got[0][first:first + count], want[0][first:first + count]
        assert logits.index(max(logits)) == reference.index(max(reference)), question.id
        first += count


@pytest.mark.parametrize("form", ["eager", "static"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_golden_case_in_mixed_packed_groups_answers_as_alone(
        executor: NativeExecutor, static_runner: ModelRunner, encodings: list[Encoding],
        alone: list[tuple[list[float], list[float]]], form: str, seed: int) -> None:
    runner = executor.runner if form == "eager" else static_runner
    assert runner.packed
    groups = _mixed_groups(seed, size=6, limit=STATIC_BUCKETS[-1])
    assert any(len(group) > 2 for group in groups)
    assert sorted(i for group in groups for i in group) == list(range(len(OK)))
    for group in groups:
        output = runner.run([encodings[i] for i in group])
        assert [row.batch_size for row in output.rows] == [len(group)] * len(group)
        for index, row in zip(group, output.rows, strict=True):
            _assert_as_alone(encodings[index], (row.logits, row.probabilities), alone[index])
    if form == "static":
        graphs = static_runner.graphs
        assert isinstance(graphs, PackedGraphRunner) and graphs.stats.replays


def test_the_static_row_packs_requests_back_to_back_and_reads_each_from_its_offset(
        static_runner: ModelRunner) -> None:
    """The dense row (`PACK_ALIGN`): no request is padded to fla's chunk, so a group costs its
    own tokens against the budget and the buckets."""
    graphs = static_runner.graphs
    assert isinstance(graphs, PackedGraphRunner)
    assert PACK_ALIGN == 1
    assert all(static.layout.align == PACK_ALIGN for static in graphs.static.values())
    ids = [[5] * 70, [6] * 1, [7] * 64]
    assert aligned_offsets([70, 1, 64]) == [0, 70, 71]
    assert aligned_total([70, 1, 64]) == 135
    assert aligned_total([70, 1, 64], align=64) == 256  # what chunk alignment would cost
    bucket = graphs.bucket_for([70, 1, 64])
    assert bucket == min(b for b in STATIC_BUCKETS if b >= 135)
    row, real = graphs.host_ids(ids, bucket)
    assert row.shape == (bucket,) and real.tolist() == list(range(135))
    assert row[real].tolist() == [5] * 70 + [6] + [7] * 64
    assert set(row.tolist()) - {5, 6, 7} == {graphs.pad_id}
    # more requests than a static row holds, or more tokens than the largest bucket: eager
    assert graphs.bucket_for([1] * 17) is None
    assert graphs.bucket_for([4000, 200]) is None


def test_the_h200_defaults_plan_at_most_32_packed_shapes() -> None:
    policy = BatchPolicy.resolve("cuda")
    assert (policy.layout, policy.max_batch_tokens, policy.max_sequences) == (PACKED, 16384, 16)
    buckets = packed_buckets(policy.max_batch_tokens, RequestLimits().max_length)
    assert len(buckets) <= 32 and buckets[-1] == 16384
    assert all(bucket % 64 == 0 for bucket in buckets)
    # every group the batcher cuts fits the largest bucket once aligned
    assert aligned_total([1000] * 16) <= buckets[-1]


def test_a_batched_executor_answer_equals_its_c1_answer(executor: NativeExecutor) -> None:
    """Through the executor's batching interface (what the serve loop runs), in one read."""
    bodies = [json.dumps(case["request"]).encode() for case in OK
              if case["max_length"] == executor.limits.max_length]
    groups = list(answer_groups(executor, bodies, executor.policy))
    assert max(len(group) for group in groups) > 1
    for group in groups:
        for position, outcome in group:
            assert outcome.error is None
            assert_same_response(outcome.value.body, executor.answer(bodies[position]).body)


def test_ready_reports_the_resolved_policy(executor: NativeExecutor) -> None:
    policy = executor.policy
    assert (policy.layout, policy.max_batch_tokens, policy.max_sequences) == (PACKED, 4096, 8)
    info = messages.ReadyInfo(**dataclasses.asdict(executor.describe()), pid=1, thread="main",
                              warmup_ms=1.0, **policy.ready_fields())  # type: ignore[arg-type]
    frame: dict[str, Any] = messages.ready(info)
    parsed = messages.ReadyInfo.from_message(frame)
    assert (parsed.batch_layout, parsed.max_batch_tokens, parsed.max_sequences) == \
        (PACKED, 4096, 8)


@requires_cuda()
def test_cuda_packed_graphs_answer_as_eager_packed_and_alone(tiny_snapshot: Path) -> None:
    """On a GPU: the packed graphs (fla varlen kernels, varlen attention, static offsets; in
    bfloat16, where those kernels run) are captured for every bucket, and mixed groups replayed
    from them answer as eager packed rows and as each case alone (every argmax equal, within
    the release's bfloat16 gate of 1e-2)."""
    def load(cuda_graphs: str) -> NativeExecutor:
        executor = assemble_snapshot(tiny_snapshot, device="cuda", dtype="bfloat16",
                                       gdn_prefill="fla", limits=RequestLimits(max_length=2048),
                                       cuda_graphs=cuda_graphs, max_batch_tokens=4096,
                                       batch_layout=PACKED, media="off")
        executor.warm_up()
        return executor

    graphs, eager = load("on"), load("off")
    info = graphs.describe()
    assert info.cuda_graphs and info.captured_shapes == info.graph_shapes and info.shapes > 0
    encodings = [with_limits(graphs, dataclasses.replace(graphs.limits,
                                                         max_length=case["max_length"]))
                 .encode(case["request"]) for case in OK]
    for group in _mixed_groups(0, size=6, limit=4096):
        batch = [encodings[i] for i in group]
        replayed, reference = graphs.runner.run(batch), eager.runner.run(batch)
        for index, got, want in zip(group, replayed.rows, reference.rows, strict=True):
            alone = eager.runner.run([encodings[index]]).rows[0]
            _assert_as_alone(encodings[index], (got.logits, got.probabilities),
                             (want.logits, want.probabilities), BF16_GATE)
            _assert_as_alone(encodings[index], (got.logits, got.probabilities),
                             (alone.logits, alone.probabilities), BF16_GATE)
    runner = graphs.runner.graphs
    assert isinstance(runner, PackedGraphRunner) and runner.stats.replays

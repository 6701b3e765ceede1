"""The start-up self-check's largest-shape group, on CPU: short requests forced into the largest
built graph shape (`ModelRunner.run(shape=...)`), so only their real tokens go through the
eager reference.

`--cuda-graphs on` on CPU builds every bucket and replays the same fixed shapes eagerly
(clef_worker.serving.gpu.capture.EagerCapturer), so the layout logic a CUDA graph replays (ids at
aligned offsets, a dummy tail of padding after them, the head reading each request's rows back)
runs here for real. Faults are injected with monkeypatch into the largest shape only, so the
probe that fails is the one forced into it: a request laid one chunk from where its sequence
starts, and a forward that reads the padding after the requests into them (what a kernel
reading past a boundary does; the stack is causal, so a correct forward never can).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from clef_protocol import messages
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu import packed_graphs
from clef_worker.serving.gpu.graphs import GraphRunner
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner, aligned_total
from clef_worker.starting import self_check
from clef_worker.starting.variant_probe import reference_runner
from tests.worker_start import start_worker

FP32_BOUND = 1e-4
LARGEST = 1024
# Graph shapes up to LARGEST tokens, the budget at LARGEST so a packed group of it is one
# forward. Padded: a budget of two rows at the largest bucket, so its largest shape is [2, 1024].
GRAPHS = ("--cuda-graphs", "on", "--max-length", "2048", "--graph-max-length", str(LARGEST),
          "--max-batch-tokens", str(LARGEST))
PADDED_GRAPHS = ("--cuda-graphs", "on", "--max-length", "2048", "--graph-max-length",
                 str(LARGEST), "--max-batch-tokens", str(2 * LARGEST), "--batch-layout", "padded")


def bucketed(snapshot: Path, layout: str = "packed") -> NativeExecutor:
    executor = assemble_snapshot(
        snapshot, device="cpu", cuda_graphs="on", media="off", batch_layout=layout,
        limits=RequestLimits(max_length=2048), graph_max_length=LARGEST,
        max_batch_tokens=LARGEST if layout == "packed" else 2 * LARGEST)
    executor.warm_up()  # builds the shapes (eagerly on CPU)
    return executor


def groups_probe(frame: dict) -> dict:
    [probe] = [p for p in frame["self_check"]["probes"] if p["name"] == "groups"]
    return probe


def replays(executor: NativeExecutor) -> dict[Any, int]:
    graphs = executor.runner.graphs
    assert graphs is not None
    return dict(graphs.stats.replays)


# -- the runner's forced shape ------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_a_forced_shape_replays_the_largest_and_answers_as_eager(tiny_snapshot: Path,
                                                                 layout: str) -> None:
    """The largest-shape group runs in the largest shape (one replay of it, where the runner
    left alone would pick a smaller one), and every request answers as it does alone through
    the plain eager forward, hidden states token by token included."""
    executor = bucketed(tiny_snapshot, layout)
    shape = self_check.largest_shape(executor)
    group = self_check.largest_group(executor, self_check.Requests(executor))
    assert group is not None and shape is not None
    lengths = [encoding.length for encoding in group]
    graphs = executor.runner.graphs
    if layout == "packed":
        assert isinstance(graphs, PackedGraphRunner)
        assert shape == (1, LARGEST) and len(group) == 3 and len(set(lengths)) == 3
        chosen = graphs.bucket_for(lengths)
        assert chosen is not None and chosen < LARGEST  # unforced, a smaller bucket
        assert aligned_total(lengths) <= LARGEST // 2 + 64  # padding fills the rest
        key: Any = LARGEST
    else:
        assert isinstance(graphs, GraphRunner)
        assert shape == (2, LARGEST) and len(group) == 2
        assert executor.runner.plan(lengths)[0].shape != shape
        key = shape
    before = replays(executor).get(key, 0)
    served = executor.runner.run(group, keep_hidden=True, shape=shape)
    assert replays(executor).get(key, 0) == before + 1
    with reference_runner(executor.runner) as plain:
        alone = [plain.run([encoding], keep_hidden=True) for encoding in group]
    for got, want in zip(served.rows, alone, strict=True):
        assert max(abs(a - b) for a, b in zip(got.probabilities, want.rows[0].probabilities,
                                              strict=True)) <= FP32_BOUND
    assert served.hidden is not None
    reference = torch.cat([answer.hidden for answer in alone if answer.hidden is not None])
    assert self_check.hidden_difference(served.hidden, reference) < 1e-4


def test_a_group_the_forced_shape_cannot_hold_is_refused(tiny_snapshot: Path) -> None:
    """A shape that is not built, too small, the wrong rows, too many requests, or graphs off:
    a ValueError that says which, never a silent run in another shape."""
    packed = bucketed(tiny_snapshot)
    requests = self_check.Requests(packed)
    group = [requests.make(300), requests.make(200)]  # 500 tokens back to back
    runner = packed.runner
    with pytest.raises(ValueError, match="take 500 aligned tokens, more than the 448-token"):
        runner.run(group, shape=(1, 448))
    with pytest.raises(ValueError, match="no 1088-token packed bucket was built"):
        runner.run(group, shape=(1, 1088))
    with pytest.raises(ValueError, match=r"a packed bucket is one row: \[1, tokens\]"):
        runner.run(group, shape=(2, LARGEST))
    many = [requests.make(requests.shortest) for _ in range(packed.policy.max_sequences + 1)]
    with pytest.raises(ValueError, match="requests do not fit a packed bucket of at most"):
        runner.run(many, shape=(1, LARGEST))
    eager = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    with pytest.raises(ValueError, match="graphs are off"):
        eager.runner.run(group, shape=(1, LARGEST))
    padded = bucketed(tiny_snapshot, "padded")
    three = [requests.make(150), requests.make(140), requests.make(130)]
    with pytest.raises(ValueError, match=r"3 requests do not fit the 2 rows of the \[2, 1024\]"):
        padded.runner.run(three, shape=(2, LARGEST))
    with pytest.raises(ValueError, match=r"a request of 300 tokens does not fit the \[1, 256\]"):
        padded.runner.run(group[:1], shape=(1, 256))


# -- the self-check's probe -------------------------------------------------------------------


@pytest.mark.parametrize("flags, largest", [(GRAPHS, [1, LARGEST]),
                                            (PADDED_GRAPHS, [2, LARGEST])])
def test_the_probe_records_the_largest_built_shape(tiny_snapshot: Path, flags: tuple[str, ...],
                                                   largest: list[int]) -> None:
    """Report mode on a sound layout: the groups probe records the largest built shape, which
    is the largest in `graph_shapes`, its last group's requests are short (about LARGEST_REAL
    real tokens at most, under half the shape) and they pass."""
    executor, frame = start_worker(tiny_snapshot, *flags, "--self-check", "report")
    assert executor is not None and frame["kind"] == messages.READY
    probe = groups_probe(frame)
    assert probe["passed"] and probe["largest_shape"] == largest
    assert largest == max(frame["graph_shapes"], key=lambda shape: (shape[1], shape[0]))
    assert probe["shapes"][-1] == ([LARGEST] if largest[0] == 1 else [largest])
    last = probe["lengths"][-1]
    assert 1 < len(last) <= largest[0] * 3 and sum(last) <= LARGEST // 2 + 64
    assert len(probe["groups"]) == 3 and max(probe["groups"]) <= FP32_BOUND


def test_without_graphs_there_is_no_largest_shape(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    executor.warm_up()
    assert self_check.largest_shape(executor) is None
    assert len(self_check.probe_groups(executor)) == 2


def test_a_largest_shape_no_request_fits_is_left_out_and_the_check_passes(
        tiny_snapshot: Path) -> None:
    """Graphs only up to 64 tokens, below the shortest request the schemas make (125 on the
    tiny snapshot): nothing can replay that shape, so there is no largest-shape group (forcing
    one would fail the check for a shape no request uses) and the check passes."""
    executor = assemble_snapshot(tiny_snapshot, device="cpu", cuda_graphs="on", media="off",
                                 limits=RequestLimits(max_length=2048), graph_max_length=64,
                                 max_batch_tokens=LARGEST)
    executor.warm_up()
    assert self_check.largest_shape(executor) == (1, 64)
    requests = self_check.Requests(executor)
    assert requests.shortest > 64
    assert self_check.largest_group(executor, requests) is None
    verdict = self_check.run_self_check(executor, "report", self_check.LAYOUT_PROBES)
    assert verdict is not None and verdict.passed
    [probe] = [p for p in verdict.probes if p["name"] == "groups"]
    assert probe["largest_shape"] is None and len(probe["groups"]) == 2


@pytest.fixture
def offset_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the largest packed bucket only: the ids laid one chunk (64 tokens) after their
    sequences' offsets, the head reading each request's rows from where its ids went. Each
    request's sequence then starts with the padding before it and runs into the next one."""
    real = PackedGraphRunner.host_ids

    def shifted(self: PackedGraphRunner, ids: Any, bucket: int) -> tuple[Any, Any]:
        row, real_rows = real(self, ids, bucket)
        if bucket != max(self.static):
            return row, real_rows
        return torch.roll(row, 64), (real_rows + 64) % bucket

    monkeypatch.setattr(PackedGraphRunner, "host_ids", shifted)


@pytest.fixture
def padding_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the largest packed bucket only: every token's hidden state picks up the last
    position's, which is always padding after the requests (a kernel that reads past the
    last sequence's boundary)."""
    real = packed_graphs.stateful_forward  # the forward every packed bucket runs

    def leaky(model: Any, input_ids: torch.Tensor, *args: Any) -> tuple[torch.Tensor, Any]:
        out, states = real(model, input_ids, *args)
        return (out + out[-1:] if input_ids.numel() == LARGEST else out), states

    monkeypatch.setattr(packed_graphs, "stateful_forward", leaky)


@pytest.mark.parametrize("fault", ["offset_fault", "padding_leak"])
def test_a_fault_in_the_largest_bucket_fails_the_probe_that_replays_it(
        tiny_snapshot: Path, fault: str, request: pytest.FixtureRequest) -> None:
    """A fault only the largest bucket has: the groups probe fails on its last forward (the
    largest-shape group), its other forwards and the small probe, which never reach that
    bucket, pass; `on` falls back to the eager packed row (shown for one fault)."""
    request.getfixturevalue(fault)
    executor, frame = start_worker(tiny_snapshot, *GRAPHS, "--self-check", "report")
    assert executor is not None
    probe = groups_probe(frame)
    assert probe["largest_shape"] == [1, LARGEST] and probe["passed"] is False
    *others, last = probe["groups"]
    assert last > FP32_BOUND and max(others) <= FP32_BOUND
    [small] = [p for p in frame["self_check"]["probes"] if p["name"] == "small"]
    assert small["passed"] is True and LARGEST not in [s[0] for s in small["shapes"] if s]
    assert frame["self_check"]["passed"] is False
    if fault == "offset_fault":
        return  # one worker start with `on` is enough to show the fallback (CPU time)
    executor, frame = start_worker(tiny_snapshot, *GRAPHS)
    assert executor is not None
    verdict = frame["self_check"]
    assert (verdict["passed"], verdict["layout"], verdict["fell_back_from"]) == \
        (True, "packed", ["packed-graphs"])

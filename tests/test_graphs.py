"""The bucket runner's bookkeeping without CUDA: which buckets are built and in what order,
static buffers written in place, fallback above the largest bucket, warm-up over every bucket,
and the packed host-to-device copy. The CUDA-graph capture itself is checked only where CUDA is
present (bench/gpu_session.sh runs this file there)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from clef_protocol.messages import ReadyInfo, ready
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.backbone import Backbone
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu.buckets import BucketTable, bucket_lengths
from clef_worker.serving.gpu.capture import (
    Forward,
    GraphMemoryMeter,
    buckets_enabled,
    graphs_enabled,
)
from clef_worker.serving.gpu.graphs import (
    GraphRunner,
    Step,
    graph_row_counts,
    pad_token_id,
    plan_shapes,
)
from clef_worker.serving.gpu.transfer import move_staged, pack, stage_host, unpack
from clef_worker.starting.warmup import build_graphs
from tests.ci_policy import requires_cuda

PAD = 7


@dataclass
class _Output:
    last_hidden_state: Tensor


class CausalToy(nn.Module):
    """A causal stand-in for the text stack: running sums of embedded ids (rows independent)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 3)
        self.calls: list[tuple[int, ...]] = []

    def forward(self, input_ids: Tensor, attention_mask: object = None,
                use_cache: bool = False) -> _Output:
        self.calls.append(tuple(input_ids.shape))
        return _Output(self.embed(input_ids).cumsum(dim=1))


class RecordingCapturer:
    """Stands in for CudaGraphCapturer: records each captured forward; a replay re-runs the
    forward closure as captured, so (like a real graph, which replays fixed addresses) it only
    sees a request written *into* the static buffer, never a buffer put in its place."""

    graphs = True

    def __init__(self) -> None:
        self.captured: list[Forward] = []
        self.sessions: list[str] = []

    def begin(self) -> None:
        self.sessions.append("begin")

    def end(self) -> None:
        self.sessions.append("end")

    def capture(self, forward: Forward) -> Forward:
        output = forward()
        self.captured.append(forward)

        def replay() -> Tensor:
            result = forward()
            assert result.shape == output.shape
            return result

        return replay

    def memory_bytes(self) -> int:
        return 0


SHAPES = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4)]


def _runner(lengths: tuple[int, ...] = (4, 8, 16),
            shapes: list[tuple[int, int]] | None = None
            ) -> tuple[GraphRunner, CausalToy, RecordingCapturer]:
    torch.manual_seed(0)
    toy = CausalToy()
    backbone = Backbone(model=toy, lexical_table=torch.zeros(16, 3), device=torch.device("cpu"),
                        dtype=torch.float32, gdn_path="torch")
    capturer = RecordingCapturer()
    return (GraphRunner(backbone, BucketTable(lengths), PAD, capturer,
                        SHAPES if shapes is None else shapes), toy, capturer)


def _padded(rows: list[list[int]], shape: tuple[int, int]) -> Tensor:
    ids = torch.full(shape, PAD)
    for row, values in enumerate(rows):
        ids[row, :len(values)] = torch.tensor(values)
    return ids


def test_build_all_builds_every_planned_shape_once_largest_first() -> None:
    runner, toy, capturer = _runner()
    assert runner.build_all() == [(4, 4), (2, 8), (1, 16), (2, 4), (1, 8), (1, 4)]
    assert capturer.sessions == ["begin", "end"]  # one accounting session around all shapes
    assert len(capturer.captured) == 6
    assert toy.calls == [(4, 4), (2, 8), (1, 16), (2, 4), (1, 8), (1, 4)]
    assert all(static.input_ids.shape == shape for shape, static in runner.static.items())
    info = runner.describe()
    assert info["graph_shapes"] == info["captured_shapes"] == [list(s) for s in sorted(SHAPES)]
    assert (info["buckets"], info["shapes"], info["cuda_graphs"]) == ([4, 8, 16], 6,
                                                                              True)


def test_the_shapes_planned_follow_the_row_counts_and_the_token_budget() -> None:
    assert graph_row_counts(16) == (1, 2, 4, 8, 16) and graph_row_counts(5) == (1, 2, 4, 5)
    table = BucketTable((64, 128, 256))
    assert plan_shapes(table, 256, (1, 2, 4)) == [(1, 64), (1, 128), (1, 256), (2, 64),
                                                  (2, 128), (4, 64)]
    # one row at every bucket even over the budget (a request alone always has its shape)
    assert plan_shapes(table, 32, (1, 2)) == [(1, 64), (1, 128), (1, 256)]


def test_ids_are_copied_into_the_static_buffer_and_the_real_rows_returned() -> None:
    runner, toy, _ = _runner()
    runner.build_all()
    static = runner.static[2, 8]
    address = static.input_ids.data_ptr()
    for rows in ([[1, 2, 3, 4, 5], [9, 8]], [[9, 8, 7, 6, 5, 4, 3]]):
        ids = _padded(rows, (len(rows), 8))
        hidden = runner.run(ids, (2, 8))
        assert static.input_ids.data_ptr() == address  # written in place, never replaced
        assert static.input_ids[:len(rows)].tolist() == ids.tolist()
        assert static.input_ids[len(rows):].eq(PAD).all()  # missing rows are pad rows
        for row, values in enumerate(rows):
            expected = toy.embed(torch.tensor([values])).cumsum(dim=1)[0]
            assert torch.allclose(hidden[row, :len(values)], expected)
    assert runner.stats.replays == {(2, 8): 2}


def test_a_shape_not_built_at_warm_up_runs_eagerly_and_is_never_captured() -> None:
    runner, toy, capturer = _runner(shapes=[(1, 8)])
    ids = _padded([[1, 2, 3]], (1, 4))
    runner.run(ids, (1, 4))  # before warm-up: nothing is built, nothing is captured now
    assert capturer.captured == [] and runner.static == {}
    runner.build_all()
    toy.calls.clear()
    for shape in ((1, 4), (2, 8)):  # neither was planned
        hidden = runner.run(_padded([[1, 2, 3]] * shape[0], shape), shape)
        assert hidden.shape == (*shape, 3)
    assert len(capturer.captured) == 1 and set(runner.static) == {(1, 8)}
    assert runner.stats.built == [(1, 8)] and runner.stats.replays == {}
    assert runner.stats.eager_fallbacks == 3 and toy.calls == [(1, 4), (2, 8)]


def test_above_the_largest_bucket_nothing_replays() -> None:
    runner, toy, _ = _runner()
    runner.build_all()
    toy.calls.clear()
    assert runner.padded_length(20) == 20
    assert runner.shape_for(1, 20) is None
    assert runner.plan([20]) == [Step((0,), None)]
    hidden = runner.run((torch.arange(20) % 16).view(1, 20), None)
    assert toy.calls == [(1, 20)] and runner.stats.replays == {}
    assert hidden.shape == (1, 20, 3)


def test_ids_that_do_not_fit_the_shape_are_refused() -> None:
    runner, _, _ = _runner()
    runner.build_all()
    with pytest.raises(ValueError, match=r"do not fit the built shape \[1, 8\]"):
        runner.run(torch.zeros(1, 7, dtype=torch.long), (1, 8))
    with pytest.raises(ValueError, match="do not fit"):
        runner.run(torch.zeros(2, 8, dtype=torch.long), (1, 8))


# -- batched or sequential -------------------------------------------------------------------


def test_a_batch_pads_to_the_next_built_row_count() -> None:
    runner, _, _ = _runner()
    runner.build_all()
    assert runner.shape_for(3, 5) is None  # (4, 8) was not built
    assert runner.shape_for(3, 4) == (4, 4)
    assert runner.shape_for(2, 5) == (2, 8)
    assert runner.shape_for(1, 9) == (1, 16)


def test_the_cheaper_of_one_batched_replay_and_one_replay_per_request_is_chosen() -> None:
    runner, _, _ = _runner()
    runner.build_all()
    # measured costs: a batched replay barely costs more than a single one (launch-bound)
    runner.costs_ms = {(1, 4): 1.0, (1, 8): 1.1, (1, 16): 1.3, (2, 4): 1.2, (2, 8): 1.4,
                       (4, 4): 1.5}
    assert runner.plan([3, 4, 2]) == [Step((0, 1, 2), (4, 4))]
    assert runner.plan([3, 7]) == [Step((0, 1), (2, 8))]
    # compute-bound: batching the padding costs more than the rows alone
    runner.costs_ms = {(1, 4): 1.0, (1, 8): 2.0, (1, 16): 4.0, (2, 4): 2.1, (2, 8): 4.5,
                       (4, 4): 4.5}
    assert runner.plan([3, 4, 2]) == [Step((0,), (1, 4)), Step((1,), (1, 4)), Step((2,), (1, 4))]
    assert runner.plan([3, 7]) == [Step((0,), (1, 4)), Step((1,), (1, 8))]
    # no batched shape holds them: one replay each; a request without a shape: all eager
    assert runner.plan([3, 5, 7]) == [Step((0,), (1, 4)), Step((1,), (1, 8)), Step((2,), (1, 8))]
    assert runner.plan([3, 30]) == [Step((0, 1), None)]


def test_without_measured_costs_padded_tokens_decide() -> None:
    runner, _, _ = _runner()
    runner.build_all()
    assert runner.plan([4, 4, 4, 4]) == [Step((0, 1, 2, 3), (4, 4))]  # a tie keeps the batch
    assert runner.plan([2, 8]) == [Step((0,), (1, 4)), Step((1,), (1, 8))]  # 16 > 4 + 8


def test_replay_all_replays_every_shape_once_and_keeps_its_time() -> None:
    runner, toy, _ = _runner()
    runner.build_all()
    toy.calls.clear()
    ticks = iter(range(100))
    costs = runner.replay_all(clock=lambda: float(next(ticks)))
    assert sorted(costs) == sorted(SHAPES) and set(costs.values()) == {1000.0}
    assert sorted(toy.calls) == sorted(SHAPES)


# -- graph memory ----------------------------------------------------------------------------


class FakeCuda:
    """The three torch.cuda calls the meter makes, over a scripted allocator."""

    def __init__(self) -> None:
        self.reserved = 0
        self.cached = 0  # reserved but free: what empty_cache gives back
        self.calls: list[str] = []

    def synchronize(self, device: object = None) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved -= self.cached
        self.cached = 0

    def memory_reserved(self, device: object = None) -> int:
        self.calls.append("memory_reserved")
        return self.reserved


def test_graph_memory_is_the_settled_growth_across_all_captures() -> None:
    cuda = FakeCuda()
    cuda.reserved, cuda.cached = 5_000, 1_000  # the model, plus blocks left by earlier forwards
    meter = GraphMemoryMeter(torch.device("cuda"), cuda)
    meter.start()
    assert cuda.calls == ["synchronize", "empty_cache", "memory_reserved"]
    cuda.reserved += 700 + 300  # the graphs' pool, and warm runs' blocks left cached
    cuda.cached = 300
    assert meter.stop() == 700 and meter.bytes == 700
    assert cuda.calls[3:] == ["synchronize", "empty_cache", "memory_reserved"]


def test_graph_memory_is_never_negative_and_needs_a_start() -> None:
    cuda = FakeCuda()
    cuda.reserved = 900
    meter = GraphMemoryMeter(torch.device("cuda"), cuda)
    with pytest.raises(RuntimeError, match="before start"):
        meter.stop()
    meter.start()
    cuda.reserved = 100
    assert meter.stop() == 0


@pytest.mark.parametrize(("mode", "device", "graphs", "buckets"), [
    ("auto", "cpu", False, False), ("on", "cpu", False, True), ("off", "cpu", False, False),
    ("auto", "cuda", True, True), ("on", "cuda", True, True), ("off", "cuda", False, False),
])
def test_modes(mode: str, device: str, graphs: bool, buckets: bool) -> None:
    assert graphs_enabled(mode, torch.device(device)) is graphs
    assert buckets_enabled(mode, torch.device(device)) is buckets


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="--cuda-graphs maybe"):
        graphs_enabled("maybe", torch.device("cpu"))


def test_pad_token_choice() -> None:
    assert pad_token_id(5, {"pad_token_id": 9}) == 5
    assert pad_token_id(None, {"pad_token_id": 9}) == 9
    assert pad_token_id(None, {}) == 0


def test_packed_copy_round_trips_shapes_and_values() -> None:
    tensors = [torch.arange(6).view(2, 3), torch.tensor([], dtype=torch.long),
               torch.tensor([7, 8]), torch.tensor(5)]
    flat = pack(tensors)
    assert flat.shape == (9,)
    for got, want in zip(unpack(flat, [t.shape for t in tensors]), tensors, strict=True):
        assert torch.equal(got, want)
    device = torch.device("meta")
    moved = move_staged(stage_host(tensors, device), [t.shape for t in tensors], device)
    assert [t.shape for t in moved] == [t.shape for t in tensors]
    assert all(t.device.type == "meta" for t in moved)
    with pytest.raises(TypeError):
        pack([torch.zeros(2)])
    with pytest.raises(ValueError):
        unpack(flat, [torch.Size([2])])


def test_warm_up_builds_every_shape_up_to_max_length(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=600), cuda_graphs="on",
                                   max_batch_tokens=512, batch_layout="padded")
    graphs = executor.runner.graphs
    assert graphs is not None
    expected = bucket_lengths(600)
    assert len(expected) == 10 and expected[-1] == 600
    planned = sorted(plan_shapes(BucketTable(expected), 512, graph_row_counts(8)))
    # before warm-up the stand-in lists the shapes it will build
    assert executor.describe().graph_shapes == [list(shape) for shape in planned]
    executor.warm_up()
    assert sorted(graphs.stats.built) == planned
    assert (8, 64) in planned and (2, 256) in planned and (2, 320) not in planned
    assert (16, 64) not in planned
    assert set(graphs.costs_ms) == set(planned)  # every shape replayed once after warm-up
    info = executor.describe()
    assert info.buckets == list(expected) and info.shapes == len(planned)
    assert info.graph_shapes == [list(shape) for shape in planned]
    assert info.captured_shapes == []  # CPU: built eagerly, nothing recorded
    assert info.cuda_graphs is False and info.graph_memory_bytes == 0
    # the ready frame carries it to the front, which parses it back
    frame = ready(ReadyInfo(**info.__dict__, pid=1, thread="MainThread", warmup_ms=1.0))
    parsed = ReadyInfo.from_message(frame)
    assert parsed.graph_shapes == info.graph_shapes and parsed.shapes == len(planned)


@requires_cuda()
def test_cuda_graph_replay_equals_eager(tiny_snapshot: Path) -> None:
    eager = assemble_snapshot(tiny_snapshot, device="cuda", dtype="float32",
                                gdn_prefill="torch", limits=RequestLimits(max_length=512),
                                cuda_graphs="off")
    graphs = assemble_snapshot(tiny_snapshot, device="cuda", dtype="float32",
                                 gdn_prefill="torch", limits=RequestLimits(max_length=512),
                                 cuda_graphs="on")
    graphs.warm_up()
    assert graphs.runner.graphs is not None and graphs.runner.graphs.graphs
    info = graphs.describe()
    assert info.graph_memory_bytes > 0 and info.captured_shapes == info.graph_shapes
    request = {"model": "m", "state": "a short state " * 20,
               "questions": {"q": {"type": "noul"}}}
    want, got = eager.score(request), graphs.score(request)
    assert max(abs(a - b) for a, b in zip(got.logits, want.logits, strict=True)) < 1e-4


class FailingCapturer(RecordingCapturer):
    """Fails as torch does when a kernel cannot be recorded: a CUDA error, which torch (2.8 on)
    raises as `torch.AcceleratorError`."""

    def capture(self, forward: Forward) -> Forward:
        if len(self.captured) == 2:
            raise torch.AcceleratorError(
                "CUDA error: operation not permitted when stream is capturing")
        return super().capture(forward)


def _failing(tiny_snapshot: Path, graphs: bool) -> NativeExecutor:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=256), cuda_graphs="on",
                                   max_batch_tokens=256, batch_layout="padded")
    assert executor.runner.graphs is not None
    capturer = FailingCapturer()
    capturer.graphs = graphs  # True: as CudaGraphCapturer on CUDA
    executor.runner.graphs.capturer = capturer
    return executor


def test_a_failed_capture_serves_eagerly_and_says_so(tiny_snapshot: Path) -> None:
    executor = _failing(tiny_snapshot, graphs=True)
    planned = sorted(executor.runner.graphs.planned)  # type: ignore[union-attr]
    executor.warm_up()
    assert executor.runner.graphs is None
    info = executor.describe()
    assert info.cuda_graphs is False and info.buckets == [] and info.captured_shapes == []
    assert info.graph_shapes == [list(shape) for shape in planned]  # what should have been
    assert "AcceleratorError" in executor.graph_failure
    request = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
    assert executor.score(request).probabilities  # still answers, eagerly


def test_a_failed_capture_on_a_broken_device_stops_the_start(tiny_snapshot: Path) -> None:
    executor = _failing(tiny_snapshot, graphs=True)
    assert executor.runner.graphs is not None
    with pytest.raises(torch.AcceleratorError, match="stream is capturing"):
        build_graphs(executor, device_usable=lambda device: False)


def test_a_failed_eager_shape_is_not_hidden(tiny_snapshot: Path) -> None:
    executor = _failing(tiny_snapshot, graphs=False)
    with pytest.raises(torch.AcceleratorError, match="stream is capturing"):
        executor.warm_up()

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
from clef_worker.gpu.buckets import BucketTable, bucket_lengths
from clef_worker.gpu.graphs import (
    BucketedBackbone,
    Forward,
    buckets_enabled,
    graphs_enabled,
    pad_token_id,
)
from clef_worker.gpu.transfer import pack, to_device_packed, unpack
from clef_worker.model.backbone import Backbone
from clef_worker.native import NativeExecutor

PAD = 7


@dataclass
class _Output:
    last_hidden_state: Tensor


class CausalToy(nn.Module):
    """A causal stand-in for the text stack: running sums of embedded ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 3)
        self.calls: list[tuple[int, ...]] = []

    def forward(self, input_ids: Tensor, use_cache: bool = False) -> _Output:
        self.calls.append(tuple(input_ids.shape))
        return _Output(self.embed(input_ids).cumsum(dim=1))


class RecordingCapturer:
    """Stands in for CudaGraphCapturer: records each captured forward; a replay re-runs the
    forward closure as captured, so (like a real graph, which replays fixed addresses) it only
    sees a request written *into* the static buffer, never a buffer put in its place."""

    def __init__(self) -> None:
        self.captured: list[Forward] = []

    def capture(self, forward: Forward) -> Forward:
        output = forward()
        self.captured.append(forward)

        def replay() -> Tensor:
            result = forward()
            assert result.shape == output.shape
            return result

        return replay

    def memory_bytes(self) -> int:
        return 1234 * len(self.captured)


def _runner(lengths: tuple[int, ...] = (4, 8, 16)) -> tuple[BucketedBackbone, CausalToy,
                                                             RecordingCapturer]:
    torch.manual_seed(0)
    toy = CausalToy()
    backbone = Backbone(model=toy, lexical_table=torch.zeros(16, 3), device=torch.device("cpu"),
                        dtype=torch.float32, gdn_path="torch")
    capturer = RecordingCapturer()
    return (BucketedBackbone(backbone, BucketTable(lengths), PAD, capturer, graphs=True), toy,
            capturer)


def test_capture_all_builds_every_bucket_once_largest_first() -> None:
    runner, toy, capturer = _runner()
    assert runner.capture_all() == [16, 8, 4]
    assert len(capturer.captured) == 3
    assert toy.calls == [(1, 16), (1, 8), (1, 4)]
    assert set(runner.buckets) == {4, 8, 16}
    assert all(static.input_ids.shape == (1, static.length) for static in runner.buckets.values())
    assert runner.describe() == {"cuda_graphs": True, "buckets": [4, 8, 16],
                                 "buckets_captured": 3, "graph_memory_bytes": 3 * 1234}


def test_requests_are_copied_into_the_static_buffer_and_the_real_rows_returned() -> None:
    runner, toy, _ = _runner()
    runner.capture_all()
    static = runner.buckets[8]
    address = static.input_ids.data_ptr()
    for ids in ([1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]):
        padded = torch.full((runner.padded_length(len(ids)),), PAD)
        padded[:len(ids)] = torch.tensor(ids)
        hidden = runner.hidden_states(padded, len(ids))
        assert static.input_ids.data_ptr() == address  # written in place, never replaced
        assert static.input_ids[0].tolist() == padded.tolist()
        expected = toy.embed(torch.tensor([ids])).cumsum(dim=1)[0]
        assert torch.allclose(hidden, expected)
    assert runner.stats.replays == {8: 2}
    assert runner.stats.captured == [16, 8, 4]  # no new capture at request time


def test_a_bucket_not_built_at_warm_up_is_built_on_first_use() -> None:
    runner, _, capturer = _runner()
    padded = torch.full((4,), PAD)
    runner.hidden_states(padded, 3)
    assert runner.stats.captured == [4]
    assert len(capturer.captured) == 1


def test_above_the_largest_bucket_runs_eagerly_and_unpadded() -> None:
    runner, toy, _ = _runner()
    ids = torch.arange(20) % 16
    assert runner.padded_length(20) == 20
    hidden = runner.hidden_states(ids, 20)
    assert toy.calls == [(1, 20)]
    assert runner.stats.eager_fallbacks == 1 and runner.stats.replays == {}
    assert hidden.shape == (20, 3)


def test_ids_padded_to_the_wrong_length_are_refused() -> None:
    runner, _, _ = _runner()
    with pytest.raises(ValueError, match="expected \\(8,\\)"):
        runner.hidden_states(torch.zeros(7, dtype=torch.long), 5)


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
    moved = to_device_packed(tensors, torch.device("meta"))
    assert [t.shape for t in moved] == [t.shape for t in tensors]
    assert all(t.device.type == "meta" for t in moved)
    with pytest.raises(TypeError):
        pack([torch.zeros(2)])
    with pytest.raises(ValueError):
        unpack(flat, [torch.Size([2])])


def test_warm_up_runs_every_bucket_up_to_max_length(tiny_snapshot: Path) -> None:
    executor = NativeExecutor.load(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=1100), cuda_graphs="on")
    assert executor.runner is not None
    executor.warm_up()
    expected = bucket_lengths(1100)
    assert len(expected) == 17 and expected[-1] == 1100
    assert executor.runner.stats.captured == list(reversed(expected))
    assert sum(executor.runner.stats.replays.values()) >= 1  # the warm-up request replayed
    info = executor.describe()
    assert info.buckets == list(expected) and info.buckets_captured == 17
    assert info.cuda_graphs is False and info.graph_memory_bytes == 0
    # the ready frame carries it to the front, which parses it back
    frame = ready(ReadyInfo(**info.__dict__, pid=1, thread="MainThread", warmup_ms=1.0))
    parsed = ReadyInfo.from_message(frame)
    assert parsed.buckets == list(expected) and parsed.buckets_captured == 17


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_replay_equals_eager(tiny_snapshot: Path) -> None:
    eager = NativeExecutor.load(tiny_snapshot, device="cuda", dtype="float32",
                                gdn_prefill="torch", limits=RequestLimits(max_length=512),
                                cuda_graphs="off")
    graphs = NativeExecutor.load(tiny_snapshot, device="cuda", dtype="float32",
                                 gdn_prefill="torch", limits=RequestLimits(max_length=512),
                                 cuda_graphs="on")
    graphs.warm_up()
    assert graphs.runner is not None and graphs.runner.graphs
    assert graphs.describe().graph_memory_bytes > 0
    request = {"model": "m", "state": "a short state " * 20,
               "questions": {"q": {"type": "noul"}}}
    want, got = eager.score(request), graphs.score(request)
    assert max(abs(a - b) for a, b in zip(got.logits, want.logits, strict=True)) < 1e-4


class FailingCapturer(RecordingCapturer):
    def capture(self, forward: Forward) -> Forward:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager_serving(tiny_snapshot: Path) -> None:
    executor = NativeExecutor.load(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=1024), cuda_graphs="on")
    assert executor.runner is not None
    executor.runner.capturer = FailingCapturer()
    executor.runner.graphs = True  # as on CUDA
    executor.warm_up()
    assert executor.runner is None
    assert executor.describe().cuda_graphs is False and executor.describe().buckets == []
    request = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}
    assert executor.score(request).probabilities  # still answers, eagerly


def test_a_failed_eager_bucket_is_not_hidden(tiny_snapshot: Path) -> None:
    executor = NativeExecutor.load(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=1024), cuda_graphs="on")
    assert executor.runner is not None
    executor.runner.capturer = FailingCapturer()
    with pytest.raises(RuntimeError, match="stream is capturing"):
        executor.warm_up()

"""How a fixed-shape forward is recorded: CUDA graphs into one shared memory pool
(`CudaGraphCapturer`, with its warm runs on a side stream and the pool's size measured by
`GraphMemoryMeter`), or the same static-buffer forward run eagerly (`EagerCapturer`: CPU,
`--cuda-graphs on` on a CPU device, and the unit tests). Both graph runners, padded
(`clef_worker.serving.gpu.graphs`) and packed (`clef_worker.serving.gpu.packed_graphs`), take a
`Capturer`, so which shape, which buffer, capture order and fallback are independent of how a shape
is run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from clef_protocol.options import CUDA_GRAPH_MODES

Forward = Callable[[], Tensor]


def graphs_enabled(mode: str, device: torch.device) -> bool:
    """`--cuda-graphs`: auto and on capture on CUDA; CPU never captures."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"--cuda-graphs {mode}: expected one of {', '.join(CUDA_GRAPH_MODES)}")
    return device.type == "cuda" and mode != "off"


def buckets_enabled(mode: str, device: torch.device) -> bool:
    """Whether requests are padded to buckets: always with graphs; on CPU only with `on`
    (padding buys nothing there, but `on` runs the whole bucket machinery eagerly)."""
    return graphs_enabled(mode, device) or mode == "on"


def prepare_capture_environment() -> None:
    """Before fla is imported: keep fla off dispatches that read lengths on the host.

    fla hands `chunk_gated_delta_rule` to FlashQLA when that package imports, and FlashQLA syncs
    with the host, which a graph capture cannot contain.
    """
    os.environ.setdefault("FLA_FLASH_QLA", "0")


class Capturer(Protocol):
    """Turns a forward over static buffers into something that replays it."""

    graphs: bool  # whether `capture` records CUDA graphs (False: replays run eagerly)

    def capture(self, forward: Forward) -> Forward:
        """Run/record `forward` once; the result re-runs it and returns its static output."""
        ...

    def begin(self) -> None:
        """Called once before the first shape is built."""
        ...

    def end(self) -> None:
        """Called once after the last shape is built."""
        ...

    def memory_bytes(self) -> int:
        """Device memory held by what was captured (0 when nothing is recorded)."""
        ...


class EagerCapturer:
    """No recording: a replay simply runs the forward again."""

    graphs = False

    def capture(self, forward: Forward) -> Forward:
        forward()
        return forward

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0


class CudaCalls(Protocol):
    """The few `torch.cuda` calls graph memory accounting needs (tests pass a fake)."""

    def synchronize(self, device: Any = None) -> None: ...

    def empty_cache(self) -> None: ...

    def memory_reserved(self, device: Any = None) -> int: ...


class GraphMemoryMeter:
    """The device memory the captured graphs hold.

    `torch.cuda.graph` empties the allocator's cache before each capture, so reserved memory
    sampled at arbitrary points reads low or high by whatever the warm runs left cached. Instead:
    synchronise and empty the cache before capturing all shapes and again after, and report the
    difference. The graphs' private pool cannot be emptied while the graphs live, so what remains
    is the pool (plus the static input buffers, which are small).
    """

    def __init__(self, device: torch.device, cuda: CudaCalls | None = None):
        self.device = device
        self.cuda: CudaCalls = cuda if cuda is not None else torch.cuda
        self._before: int | None = None
        self.bytes = 0

    def _settled_reserved(self) -> int:
        self.cuda.synchronize(self.device)
        self.cuda.empty_cache()
        return int(self.cuda.memory_reserved(self.device))

    def start(self) -> None:
        self._before = self._settled_reserved()

    def stop(self) -> int:
        if self._before is None:
            raise RuntimeError("GraphMemoryMeter.stop before start")
        self.bytes = max(0, self._settled_reserved() - self._before)
        self._before = None
        return self.bytes


class CudaGraphCapturer:
    """Records each forward into a `torch.cuda.CUDAGraph` sharing one memory pool."""

    graphs = True

    def __init__(self, device: torch.device, warm_runs: int = 2):
        self.device = device
        self.warm_runs = warm_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.recorded: list[torch.cuda.CUDAGraph] = []
        # One side stream for every warm-up run (torch.cuda.graph's documentation prescribes
        # warming off the capture stream; one stream, not one per shape).
        self.stream = torch.cuda.Stream(device)
        self.meter = GraphMemoryMeter(device)

    def begin(self) -> None:
        self.meter.start()

    def end(self) -> None:
        self.meter.stop()

    def capture(self, forward: Forward) -> Forward:
        # Warm first (Triton autotuning, lazy inits, cuBLAS workspaces must not happen during
        # capture).
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(self.warm_runs):
                forward()
        current.wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.recorded.append(graph)

        def replay() -> Tensor:
            graph.replay()
            return output

        return replay

    def memory_bytes(self) -> int:
        """The graphs' pool, as measured around capturing all shapes (GraphMemoryMeter)."""
        return self.meter.bytes

"""The backbone forward over padded length buckets, captured as CUDA graphs on CUDA.

Why: a short request on a GPU is launch-bound, not compute-bound (hundreds of small kernels,
each with host overhead). Replaying a CUDA graph launches the whole recorded forward at once.
A graph replays fixed shapes at fixed addresses, so each bucket (clef_worker.gpu.buckets) owns a
*static* input buffer: a request's ids (already right-padded to the bucket on the host) are copied
into it in place, the graph replays, and the head reads the real rows of the static output.

The logic (which bucket, which buffer, capture order, fallback, warm-up count) is independent of
how a bucket is run, so it takes a `Capturer`: `CudaGraphCapturer` records real graphs into one
shared memory pool (largest bucket first, so smaller graphs reuse its blocks), `EagerCapturer`
runs the same static-buffer forward without recording (CPU, `--cuda-graphs off` with buckets on,
and the unit tests, which substitute their own capturer to check the bookkeeping).

What is not captured: the joint head (its shapes depend on the question and option counts of each
request) and batches of more than one request (clef_worker.batching runs them eagerly, padded to
one bucket). Lengths above the largest bucket run eagerly, unpadded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from clef_protocol.options import CUDA_GRAPH_MODES
from clef_worker.gpu.buckets import BucketTable
from clef_worker.model.backbone import Backbone

log = logging.getLogger(__name__)

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
    with the host, which a graph capture cannot contain (../shared/docs/gpu-notes.md).
    """
    os.environ.setdefault("FLA_FLASH_QLA", "0")


class Capturer(Protocol):
    """Turns a forward over static buffers into something that replays it."""

    def capture(self, forward: Forward) -> Forward:
        """Run/record `forward` once; the result re-runs it and returns its static output."""
        ...

    def memory_bytes(self) -> int:
        """Device memory held by what was captured (0 when nothing is recorded)."""
        ...


class EagerCapturer:
    """No recording: a replay simply runs the forward again."""

    def capture(self, forward: Forward) -> Forward:
        forward()
        return forward

    def memory_bytes(self) -> int:
        return 0


class CudaGraphCapturer:
    """Records each forward into a `torch.cuda.CUDAGraph` sharing one memory pool."""

    def __init__(self, device: torch.device, warm_runs: int = 2):
        self.device = device
        self.warm_runs = warm_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._reserved_before = torch.cuda.memory_reserved(device)

    def capture(self, forward: Forward) -> Forward:
        # Warm on a side stream first (Triton autotuning, lazy inits, cuBLAS workspaces must not
        # happen during capture), as torch.cuda.graph's documentation prescribes.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warm_runs):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)

        def replay() -> Tensor:
            graph.replay()
            return output

        return replay

    def memory_bytes(self) -> int:
        """Growth of the caching allocator's reserved memory since this capturer was made (at
        load, before warm-up): the graphs' shared pool plus what the warm runs left cached."""
        return max(0, torch.cuda.memory_reserved(self.device) - self._reserved_before)


@dataclass
class StaticBucket:
    """One bucket's fixed-address input and its replayable forward."""

    length: int
    input_ids: Tensor  # [1, length] on the device; written in place, never replaced
    replay: Forward  # returns [1, length, H], valid until the next replay of any bucket


@dataclass
class BucketStats:
    """Counters for logs, `/health` and tests."""

    captured: list[int] = field(default_factory=list)  # bucket lengths, in capture order
    replays: dict[int, int] = field(default_factory=dict)
    eager_fallbacks: int = 0
    capture_ms: float = 0.0


class BucketedBackbone:
    """Runs the text stack at bucket lengths through static buffers (captured or eager)."""

    def __init__(self, backbone: Backbone, table: BucketTable, pad_id: int,
                 capturer: Capturer, *, graphs: bool):
        self.backbone = backbone
        self.table = table
        self.pad_id = pad_id
        self.capturer = capturer
        self.graphs = graphs
        self.buckets: dict[int, StaticBucket] = {}
        self.stats = BucketStats()

    def padded_length(self, length: int) -> int:
        """The length a request of `length` tokens is padded to on the host (itself above the
        largest bucket)."""
        return self.table.select(length) or length

    def capture_all(self) -> list[int]:
        """Build every bucket, largest first (the shared pool is sized by the first capture);
        returns the bucket lengths in the order they were built."""
        started = time.perf_counter()
        with torch.inference_mode():  # static buffers are inference tensors, written in place
            for length in reversed(self.table.lengths):
                self._build(length)
        self.stats.capture_ms += (time.perf_counter() - started) * 1000
        return list(self.stats.captured)

    def hidden_states(self, padded_ids: Tensor, length: int) -> Tensor:
        """[padded_length(length)] ids on the device (right-padded) -> [length, H].

        The result of a bucketed run is a view of a static buffer: use it before the next call.
        """
        bucket = self.table.select(length)
        with torch.inference_mode():
            if bucket is None:
                self.stats.eager_fallbacks += 1
                return self.backbone.hidden_states(padded_ids[:length])
            if padded_ids.shape != (bucket,):
                raise ValueError(f"ids padded to {tuple(padded_ids.shape)}, expected ({bucket},)")
            static = self.buckets.get(bucket) or self._build(bucket)
            static.input_ids[0].copy_(padded_ids, non_blocking=True)
            self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1
            return static.replay()[0, :length]

    def _build(self, length: int) -> StaticBucket:
        input_ids = torch.full((1, length), self.pad_id, dtype=torch.long,
                               device=self.backbone.device)
        model = self.backbone.model

        def forward() -> Tensor:
            return model(input_ids=input_ids, use_cache=False).last_hidden_state

        static = StaticBucket(length=length, input_ids=input_ids,
                              replay=self.capturer.capture(forward))
        self.buckets[length] = static
        self.stats.captured.append(length)
        return static

    def describe(self) -> dict[str, Any]:
        """What `ready` and `/health` report about the buckets."""
        return {
            "cuda_graphs": self.graphs,
            "buckets": list(self.table.lengths),
            "buckets_captured": len(self.buckets),
            "graph_memory_bytes": self.capturer.memory_bytes(),
        }


def pad_token_id(endoftext: int | None, config: dict[str, Any]) -> int:
    """The id right padding uses: the tokenizer's `<|endoftext|>` (Qwen's pad token, never
    produced by the prompt template), else the config's pad_token_id, else 0.

    Any id gives the same real-position outputs (the stack is causal); a pad token keeps the
    padded rows meaningless rather than looking like content when someone inspects them.
    """
    if endoftext is not None:
        return endoftext
    candidate = config.get("pad_token_id")
    return candidate if isinstance(candidate, int) and candidate >= 0 else 0

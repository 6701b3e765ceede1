"""The backbone over packed rows, one CUDA graph per total-token bucket.

Why: with the packed layout (clef_worker.model.packed) a forward is one row of the requests'
tokens end to end, so its shape is only its total token count. One graph per total-token bucket
(the bucket table of clef_worker.serving.gpu.buckets, up to the largest forward the batch policy
forms) replays any mix of lengths: at the H200 defaults (16,384 tokens, 16 requests) that is 29
shapes,
where padded `[rows, bucket]` graphs needed about 110.

A graph replays fixed kernel grids at fixed addresses, so each bucket owns a static ids buffer
and a dense `StaticPackedLayout` (clef_worker.model.packed, `align=1`): the requests back to
back, a dummy tail sequence filling the bucket, and fla's chunk pairs padded to a fixed count
with pairs of an empty slot; the offsets are rewritten in place before each replay. (Aligning
every request to fla's 64-token chunk also fixes the grid, but a ~393-token request then takes
448 tokens: 12 % more work in every layer, where the dense row adds at most one chunk per
request to the Gated DeltaNet kernels alone.) `PACK_ALIGN` names the choice; the group's token
cost against `--max-batch-tokens` is its total under it (`aligned_total`), so every group the
batcher forms fits the largest bucket. The runner lays the ids out at those offsets on the host
(`host_ids`) and reads each request's rows back from its offset (`real_rows`).

The buckets are spaced by what padding costs in time (`cost_bucket_lengths`): 29 at the H200
defaults, from 64 tokens by 64 to 192, then 128 up to ~900, then about 1.12x.

As with the padded graphs, capture happens at warm-up only (`build_all`, largest first, in one
memory pool through a `Capturer`); a forward no bucket holds runs eagerly and unpadded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from clef_worker.model.backbone import Backbone
from clef_worker.model.lora import AdapterSelection
from clef_worker.model.packed import (
    FLA_CHUNK,
    StaticPackedLayout,
    aligned_length,
    static_sequences,
)
from clef_worker.model.packed_kernels import PackedKernels, kernels_for
from clef_worker.model.packed_layers import stateful_forward
from clef_worker.model.stateful import StateOutputs
from clef_worker.serving.gpu.buckets import cost_bucket_lengths
from clef_worker.serving.gpu.capture import Capturer, Forward
from clef_worker.serving.gpu.state_buffers import RowSequence, StateBuffers, StateShapes, fresh

log = logging.getLogger(__name__)


# How requests are placed in a packed bucket's static row: back to back (see the module docs).
PACK_ALIGN = 1


def aligned_total(lengths: Sequence[int], align: int = PACK_ALIGN) -> int:
    """Tokens a static packed row needs for these requests (each aligned to `align`)."""
    return sum(aligned_length(int(length), align) for length in lengths)


def aligned_offsets(lengths: Sequence[int], align: int = PACK_ALIGN) -> list[int]:
    """Where each request starts in a static packed row."""
    starts, first = [], 0
    for length in lengths:
        starts.append(first)
        first += aligned_length(int(length), align)
    return starts


def packed_buckets(max_batch_tokens: int, max_length: int, graph_max_length: int = 0,
                   align: int = FLA_CHUNK) -> tuple[int, ...]:
    """The total-token buckets to capture: the cost-spaced table (multiples of `align`, 64) up
    to the largest forward the policy forms, the budget or one request of `max_length`
    (rounded up to `align`), cut at `graph_max_length` when given."""
    largest = max(aligned_length(max_batch_tokens, align), aligned_length(max_length, align))
    if graph_max_length:
        largest = min(largest, aligned_length(graph_max_length, align))
    return cost_bucket_lengths(largest, step=align)


@dataclass
class PackedStatic:
    """One bucket's fixed-address ids, its static layout and its replayable forward."""

    tokens: int
    input_ids: Tensor  # [tokens] on the device; written in place, never replaced
    layout: StaticPackedLayout
    replay: Forward  # returns [tokens, H], valid until the next replay of any bucket
    # With fine-tuned variants: each token's slot (clef_worker.model.lora), written in place.
    slots: Tensor | None = None


@dataclass
class PackedStats:
    """Counters for logs, `/health` and tests."""

    built: list[int] = field(default_factory=list)  # buckets in build order
    replays: dict[int, int] = field(default_factory=dict)
    capture_ms: float = 0.0
    # Replays whose row continued cached prefixes or stored points
    # (clef_worker.serving.prefix.graphed).
    state_replays: int = 0


class PackedGraphRunner:
    """Runs the text stack over packed rows at built total-token buckets."""

    def __init__(self, backbone: Backbone, buckets: Sequence[int], max_sequences: int,
                 pad_id: int, capturer: Capturer, selection: AdapterSelection | None = None,
                 state_inputs: bool = True):
        self.backbone = backbone
        # Fine-tuned variants: each bucket's forward runs the stacked LoRA path over a static
        # slot buffer (`host_slots` fills it per group), so one capture serves every mix.
        self.selection = selection
        self.planned = tuple(buckets)
        self.max_sequences = max_sequences
        self.pad_id = pad_id
        self.capturer = capturer
        self.static: dict[int, PackedStatic] = {}
        self.costs_ms: dict[int, float] = {}
        self.stats = PackedStats()
        # The state inputs every bucket reads (clef_worker.serving.gpu.state_buffers), made at build
        # time; their keys hold twice the largest bucket: a full row beside one cached prefix
        # as long as the longest request.
        self.states: StateBuffers | None = None
        self.state_kernels: PackedKernels | None = None
        self.outputs = StateOutputs([], [])  # the last replay's final states (static on CUDA)
        # False: the buckets' forward without state inputs (prefix-cache groups eager).
        self.state_inputs = state_inputs

    @property
    def graphs(self) -> bool:
        return self.capturer.graphs

    def bucket_for(self, lengths: Sequence[int]) -> int | None:
        """The smallest built bucket holding these requests aligned; None: run eagerly."""
        if len(lengths) > self.max_sequences:
            return None
        need = aligned_total(lengths)
        fitting = [tokens for tokens in self.static if tokens >= need]
        return min(fitting) if fitting else None

    def check_bucket(self, lengths: Sequence[int], bucket: int) -> int:
        """`bucket`, chosen by the caller instead of `bucket_for` (the start-up self-check
        forces short requests into the largest one, so its eager reference runs only their
        real tokens), once it is known to hold them: built at warm-up, at most
        `max_sequences` requests, their aligned total within it. ValueError otherwise, saying
        which."""
        if bucket not in self.static:
            raise ValueError(f"no {bucket}-token packed bucket was built (built: "
                             f"{sorted(self.static)})")
        if len(lengths) > self.max_sequences:
            raise ValueError(f"{len(lengths)} requests do not fit a packed bucket of at most "
                             f"{self.max_sequences}")
        need = aligned_total(lengths)
        if need > bucket:
            raise ValueError(f"requests of {list(lengths)} tokens take {need} aligned tokens, "
                             f"more than the {bucket}-token bucket holds")
        return bucket

    def host_ids(self, ids: Sequence[Sequence[int]], bucket: int) -> tuple[Tensor, Tensor]:
        """The bucket's ids on the host (each request at its aligned offset, pad ids between
        and after) and the positions of the real tokens in it, request after request."""
        row = torch.full((bucket,), self.pad_id, dtype=torch.long)
        real: list[Tensor] = []
        for start, tokens in zip(aligned_offsets([len(t) for t in ids]), ids, strict=True):
            row[start:start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            real.append(torch.arange(start, start + len(tokens)))
        return row, torch.cat(real)

    def host_slots(self, lengths: Sequence[int], slots: Sequence[int], bucket: int) -> Tensor:
        """Each position's variant slot in the bucket's row as `host_ids` lays it out (0, the
        base, between and after the requests)."""
        row = torch.zeros(bucket, dtype=torch.long)
        for start, length, slot in zip(aligned_offsets(lengths), lengths, slots, strict=True):
            row[start:start + length] = slot
        return row

    # -- warm-up -----------------------------------------------------------------------------

    def build_all(self) -> list[int]:
        """Build (capture) every planned bucket, largest first; the only place one is built."""
        started = time.perf_counter()
        if self.state_inputs and self.states is None and self.planned:
            self._make_states()
        self.capturer.begin()
        try:
            with torch.inference_mode():
                try:
                    self._build_every()
                except Exception:
                    if self.states is None:
                        raise
                    # Never a worker that cannot start for the sake of the prefix cache: the
                    # buckets without state inputs, prefix-cache groups eager (as before).
                    log.exception("the packed forward with state inputs failed: buckets are "
                                  "built without them; prefix-cache groups run the eager "
                                  "prefixed forward")
                    self.states = self.state_kernels = None
                    self.static.clear()
                    self.stats.built.clear()
                    self._build_every()
        finally:
            self.capturer.end()
        self.stats.capture_ms += (time.perf_counter() - started) * 1000
        return list(self.stats.built)

    def _make_states(self) -> None:
        """The shared state buffers, one row per sequence of a static row (the dummy tail and
        the dense row's empty slot included: their rows stay zero), and the packed kernels
        (the backbone's, fused ops and all). Captured graphs need kernels that take state
        inputs without host reads (`state_safe`); otherwise the buckets run without them."""
        backbone = self.backbone
        kernels = backbone.packed_kernels or kernels_for(backbone.device, backbone.dtype,
                                                         backbone.gdn_path)
        if self.graphs and not kernels.state_safe:
            log.warning("packed kernels %s cannot capture state inputs: prefix-cache groups "
                        "run the eager prefixed forward", kernels.names)
            return
        largest = max(self.planned)
        self.states = StateBuffers(StateShapes.of(backbone.model),
                                   static_sequences(self.max_sequences, PACK_ALIGN), largest,
                                   2 * largest, backbone.device, backbone.dtype)
        self.state_kernels = kernels

    def _build_every(self) -> None:
        for tokens in sorted(self.planned, reverse=True):
            self._build(tokens)

    def _build(self, tokens: int) -> None:
        device = self.backbone.device
        input_ids = torch.full((tokens,), self.pad_id, dtype=torch.long, device=device)
        layout = StaticPackedLayout(tokens, self.max_sequences, device, align=PACK_ALIGN)
        backbone = self.backbone
        selection = self.selection
        slots = (torch.zeros(tokens, dtype=torch.long, device=device)
                 if selection is not None else None)

        states, kernels = self.states, self.state_kernels

        def stateful() -> Tensor:
            if states is None or kernels is None:
                return backbone.packed_hidden_state(input_ids, layout.layout())
            hidden, self.outputs = stateful_forward(backbone.model, input_ids, layout.layout(),
                                                    kernels, states.inputs(tokens))
            return hidden

        if states is not None:
            states.clear_rows()
            states.fill(layout.layout(), fresh([tokens]))

        def forward() -> Tensor:
            if selection is None or slots is None:
                return stateful()
            with selection.replaying(slots):
                return stateful()

        self.static[tokens] = PackedStatic(tokens, input_ids, layout,
                                           self.capturer.capture(forward), slots)
        self.stats.built.append(tokens)

    def replay_all(self, clock: Callable[[], float] | None = None) -> dict[int, float]:
        """Replay every bucket once (no first hit pays a lazy cost); keep each one's time."""
        clock = clock or self._synchronised_clock
        with torch.inference_mode():
            for tokens, static in self.static.items():
                started = clock()
                static.replay()
                self.costs_ms[tokens] = (clock() - started) * 1000
        return dict(self.costs_ms)

    def _synchronised_clock(self) -> float:
        if self.backbone.device.type == "cuda":
            torch.cuda.synchronize(self.backbone.device)
        return time.perf_counter()

    # -- running -----------------------------------------------------------------------------

    def run(self, ids: Tensor, lengths: Sequence[int], bucket: int,
            slots: Tensor | None = None,
            sequences: Sequence[RowSequence] | None = None) -> Tensor:
        """Last hidden state [bucket, H] of a packed row laid out by `host_ids` (on the
        device): the offsets are written into the bucket's static layout, the ids into its
        buffer, and its graph replays. A view of a static buffer: use it before the next
        replay. `sequences`: how each continues a cached prefix, its state rows and cached
        keys already written (clef_worker.serving.prefix.graphed); None: every sequence fresh."""
        static = self.static[bucket]
        if ids.shape != (bucket,):
            raise ValueError(f"ids of shape {tuple(ids.shape)} for the {bucket}-token bucket")
        layout = static.layout.fill(lengths)
        if self.states is None:
            if sequences is not None:
                raise ValueError("these buckets were built without state inputs")
        elif sequences is None:
            self.states.clear_rows()
            self.states.fill(layout, fresh(lengths))
        else:
            self.states.fill(layout, sequences)
            self.stats.state_replays += 1
        static.input_ids.copy_(ids, non_blocking=True)
        if static.slots is not None:
            if slots is None:
                static.slots.zero_()
            else:
                static.slots.copy_(slots, non_blocking=True)
        self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1
        return static.replay()

    def covers(self, length: int) -> bool:
        """Whether a lone request of `length` tokens replays a built bucket."""
        return self.bucket_for([length]) is not None

    def planned_shapes(self) -> list[list[int]]:
        """Every planned bucket as a `[rows, tokens]` shape (one packed row)."""
        return [[1, tokens] for tokens in sorted(self.planned)]

    def describe(self) -> dict[str, Any]:
        """What `ready` and `/health` report: a packed shape is one row of a bucket's tokens."""
        built = [[1, tokens] for tokens in sorted(self.stats.built)]
        return {
            "cuda_graphs": self.graphs,
            "buckets": list(self.planned),
            "shapes": len(self.static),
            "graph_shapes": built or self.planned_shapes(),
            "captured_shapes": built if self.graphs else [],
            "graph_memory_bytes": self.capturer.memory_bytes(),
        }

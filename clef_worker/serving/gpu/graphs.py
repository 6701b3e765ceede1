"""The backbone forward over padded `[rows, tokens]` shapes, captured as CUDA graphs on CUDA.

Why: a short request on a GPU is launch-bound, not compute-bound (hundreds of small kernels,
each with host overhead). Replaying a CUDA graph launches the whole recorded forward at once.
A graph replays fixed shapes at fixed addresses, so each shape owns a *static* input buffer: a
forward's ids (already right-padded on the host to the shape's tokens, and with pad rows up to
its rows) are copied into it in place, the graph replays, and the head reads the real rows of
the static output.

Shapes (the padded layout, `--batch-layout padded`; the packed layout's graphs are
clef_worker.serving.gpu.packed_graphs): one row per request at every length bucket
(clef_worker.serving.gpu.buckets), and for batches the row counts the batcher forms (powers of two
up to the batch policy's `max_sequences`, clef_worker.serving.policy) at every bucket where rows x
tokens fits
`--max-batch-tokens`. A batch of n requests pads to the smallest built row
count of at least n; `GraphRunner.plan` then chooses, by expected cost (each shape's replay time
measured once after warm-up), between that one batched replay and one replay per request.

Capture happens only during warm-up (`build_all`), as vLLM also enforces: a shape not built then
(a row count or length beyond the table) runs eagerly and unpadded, and is never captured on the
request path, where a capture would stall every request behind it and allocate pool memory.

The logic (which shape, which buffer, capture order, fallback) is independent of how a shape is
run, so it takes a `Capturer`: `CudaGraphCapturer` records real graphs into one shared memory
pool (largest shape first, so smaller graphs reuse its blocks) and warms every shape on one side
stream; `EagerCapturer` runs the same static-buffer forward without recording (CPU,
`--cuda-graphs on` on a CPU device, and the unit tests, which substitute their own capturer).

Fine-tuned variants (clef_worker.model.lora): with a selection given, each shape also owns a
static per-token slot buffer (`rows x tokens`, row-major like the flattened forward) and its
forward runs the stacked LoRA path over it, so one capture serves every mix of variants; `run`
rewrites it before each replay (a request's whole row is its slot, the pad rows the base's).

What is not captured: the joint head (its shapes depend on the question and option counts of each
request) and media requests (the vision tower runs eagerly, alone).
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
from clef_worker.serving.gpu.buckets import BucketTable
from clef_worker.serving.gpu.capture import (
    Capturer,
    Forward,
)

log = logging.getLogger(__name__)

Shape = tuple[int, int]  # (rows, tokens)


def graph_row_counts(max_rows: int) -> tuple[int, ...]:
    """The row counts captured for a policy of at most `max_rows` requests per forward: 1,
    then powers of two, then `max_rows` itself (a batch pads up to the next one, wasting less
    than half its rows)."""
    counts = [1]
    while counts[-1] * 2 <= max_rows:
        counts.append(counts[-1] * 2)
    if counts[-1] < max_rows:
        counts.append(max_rows)
    return tuple(counts)


def plan_shapes(table: BucketTable, max_batch_tokens: int,
                row_counts: Sequence[int]) -> list[Shape]:
    """Every shape to build at warm-up: one row at every bucket, and each larger row count at
    the buckets where rows x tokens stays within `max_batch_tokens` (the batcher never forms a
    forward beyond that budget). Sorted by rows, then tokens."""
    shapes = [(1, length) for length in table.lengths]
    shapes += [(rows, length) for rows in sorted(set(row_counts)) if rows > 1
               for length in table.lengths if rows * length <= max_batch_tokens]
    return shapes


@dataclass
class StaticShape:
    """One shape's fixed-address input and its replayable forward."""

    rows: int
    tokens: int
    input_ids: Tensor  # [rows, tokens] on the device; written in place, never replaced
    replay: Forward  # returns [rows, tokens, H], valid until the next replay of any shape
    # With fine-tuned variants: each token's slot, [rows * tokens], written in place.
    slots: Tensor | None = None


@dataclass
class GraphStats:
    """Counters for logs, `/health` and tests."""

    built: list[Shape] = field(default_factory=list)  # in build order
    replays: dict[Shape, int] = field(default_factory=dict)
    eager_fallbacks: int = 0
    capture_ms: float = 0.0


@dataclass(frozen=True)
class Step:
    """One forward of a plan: the requests (indices) it answers and the shape it replays
    (None: eager, unpadded)."""

    members: tuple[int, ...]
    shape: Shape | None


class GraphRunner:
    """Runs the text stack at built shapes through static buffers (captured or eager)."""

    def __init__(self, backbone: Backbone, table: BucketTable, pad_id: int,
                 capturer: Capturer, shapes: Sequence[Shape] | None = None,
                 selection: AdapterSelection | None = None):
        self.backbone = backbone
        # Fine-tuned variants: each shape's forward runs the stacked LoRA path over a static
        # slot buffer (`host_slots` lays it out per forward), so one capture serves every mix.
        self.selection = selection
        self.table = table
        self.pad_id = pad_id
        self.capturer = capturer
        self.planned: list[Shape] = list(shapes) if shapes is not None else \
            [(1, length) for length in table.lengths]
        self.static: dict[Shape, StaticShape] = {}
        self.costs_ms: dict[Shape, float] = {}  # measured replay times (after warm-up)
        self.stats = GraphStats()

    @property
    def graphs(self) -> bool:
        return self.capturer.graphs

    def padded_length(self, length: int) -> int:
        """The length a request of `length` tokens is padded to on the host (itself above the
        largest bucket)."""
        return self.table.select(length) or length

    # -- warm-up -----------------------------------------------------------------------------

    def build_all(self) -> list[Shape]:
        """Build (capture) every planned shape, largest first (the shared pool is sized by the
        first capture); returns the shapes in the order they were built. The only place a
        shape is ever built."""
        started = time.perf_counter()
        order = sorted(self.planned, key=lambda shape: (shape[0] * shape[1], shape), reverse=True)
        self.capturer.begin()
        try:
            with torch.inference_mode():  # static buffers are inference tensors, written in place
                for shape in order:
                    self._build(shape)
        finally:
            self.capturer.end()
        self.stats.capture_ms += (time.perf_counter() - started) * 1000
        return list(self.stats.built)

    def replay_all(self, clock: Callable[[], float] | None = None) -> dict[Shape, float]:
        """Replay every built shape once (so no first hit pays a lazy cost) and keep each one's
        time as its expected cost for `plan`."""
        clock = clock or self._synchronised_clock
        with torch.inference_mode():
            for shape, static in self.static.items():
                started = clock()
                static.replay()
                self.costs_ms[shape] = (clock() - started) * 1000
        return dict(self.costs_ms)

    def _synchronised_clock(self) -> float:
        if self.backbone.device.type == "cuda":
            torch.cuda.synchronize(self.backbone.device)
        return time.perf_counter()

    def _build(self, shape: Shape) -> StaticShape:
        rows, tokens = shape
        input_ids = torch.full((rows, tokens), self.pad_id, dtype=torch.long,
                               device=self.backbone.device)
        backbone = self.backbone
        selection = self.selection
        slots = (torch.zeros(rows * tokens, dtype=torch.long, device=self.backbone.device)
                 if selection is not None else None)

        def forward() -> Tensor:
            if selection is None or slots is None:
                return backbone.last_hidden_state(input_ids)
            with selection.replaying(slots):
                return backbone.last_hidden_state(input_ids)

        static = StaticShape(rows=rows, tokens=tokens, input_ids=input_ids,
                             replay=self.capturer.capture(forward), slots=slots)
        self.static[shape] = static
        self.stats.built.append(shape)
        return static

    # -- choosing and running ----------------------------------------------------------------

    def shape_for(self, rows: int, longest: int) -> Shape | None:
        """The built shape a forward of `rows` requests up to `longest` tokens pads to: the
        smallest built row count of at least `rows` at the bucket of `longest`; None when no
        shape holds it (it then runs eagerly)."""
        bucket = self.table.select(longest)
        if bucket is None:
            return None
        counts = sorted(r for r, t in self.static if t == bucket and r >= rows)
        return (counts[0], bucket) if counts else None

    def forced_step(self, lengths: Sequence[int], shape: Shape) -> Step:
        """One replay of every request at `shape`, chosen by the caller instead of `plan` (the
        start-up self-check forces short requests into the largest shape, so its eager
        reference runs only their real tokens), once it is known to hold them: built at
        warm-up, at least one row per request, every request within its tokens. ValueError
        otherwise, saying which."""
        rows, tokens = shape
        if (rows, tokens) not in self.static:
            raise ValueError(f"no {[rows, tokens]} padded shape was built (built: "
                             f"{sorted(list(s) for s in self.static)})")
        if len(lengths) > rows:
            raise ValueError(f"{len(lengths)} requests do not fit the {rows} rows of the "
                             f"{[rows, tokens]} shape")
        if max(lengths) > tokens:
            raise ValueError(f"a request of {max(lengths)} tokens does not fit the "
                             f"{[rows, tokens]} shape")
        return Step(tuple(range(len(lengths))), (rows, tokens))

    def expected_cost(self, shape: Shape) -> float:
        """A built shape's replay time as measured after warm-up; before that (and in tests
        that set no costs), its padded token count, a cost in another unit but the same for
        every shape, which is all a comparison needs."""
        if self.costs_ms and shape in self.costs_ms:
            return self.costs_ms[shape]
        return float(shape[0] * shape[1])

    def plan(self, lengths: Sequence[int]) -> list[Step]:
        """How to run a forward of requests with these token counts: one batched replay, one
        replay per request, or (when no built shape holds them) one eager forward.

        The batched replay wins when its expected cost is at most the sum of the single-row
        replays' (it also keeps the requests in one forward, a tie goes to it)."""
        everyone = tuple(range(len(lengths)))
        batched = self.shape_for(len(lengths), max(lengths))
        if len(lengths) == 1:
            return [Step(everyone, batched)]
        singles = [self.shape_for(1, length) for length in lengths]
        sequential = [Step((index,), shape) for index, shape in enumerate(singles)]
        if any(shape is None for shape in singles):
            return [Step(everyone, batched)]  # eager when `batched` is None too
        if batched is None:
            return sequential
        alone = sum(self.expected_cost(shape) for shape in singles if shape is not None)
        return [Step(everyone, batched)] if self.expected_cost(batched) <= alone else sequential

    def host_slots(self, slots: Sequence[int], rows: int, tokens: int) -> Tensor:
        """The per-token slot index of a `[rows, tokens]` forward whose row i is a request of
        variant `slots[i]` (its pad tokens included; the pad rows after them the base's)."""
        index = torch.zeros((rows, tokens), dtype=torch.long)
        index[:len(slots)] = torch.tensor(list(slots), dtype=torch.long)[:, None]
        return index.reshape(-1)

    def run(self, ids: Tensor, shape: Shape | None, slots: Tensor | None = None) -> Tensor:
        """Last hidden state of `ids` ([rows, tokens], on the device, right-padded): replayed
        from the built `shape` (ids are copied into its static buffer; pad rows fill the rest),
        or eagerly at the ids' own shape when `shape` is None or was not built at warm-up.
        With variants, `slots` (`host_slots` of the ids' rows, on the device) is copied into the
        shape's slot buffer; none given: every token the base's. An eager forward reads the
        selection the caller set instead.

        A replay's result is a view of a static buffer: use it before the next replay.
        """
        with torch.inference_mode():
            static = self.static.get(shape) if shape is not None else None
            if static is None:
                self.stats.eager_fallbacks += 1
                return self.backbone.last_hidden_state(ids)
            rows, tokens = ids.shape
            if tokens != static.tokens or rows > static.rows:
                raise ValueError(f"ids of shape {tuple(ids.shape)} do not fit the built shape "
                                 f"{[static.rows, static.tokens]}")
            static.input_ids[:rows].copy_(ids, non_blocking=True)
            if rows < static.rows:
                static.input_ids[rows:].fill_(self.pad_id)
            if static.slots is not None:
                if slots is None:
                    static.slots.zero_()
                else:
                    static.slots[:slots.shape[0]].copy_(slots, non_blocking=True)
                    static.slots[slots.shape[0]:].zero_()
            self.stats.replays[static.rows, static.tokens] = \
                self.stats.replays.get((static.rows, static.tokens), 0) + 1
            return static.replay()

    def covers(self, length: int) -> bool:
        """Whether a lone request of `length` tokens replays a built shape."""
        return self.shape_for(1, length) is not None

    def planned_shapes(self) -> list[list[int]]:
        """Every planned `[rows, tokens]` shape, sorted."""
        return [list(shape) for shape in sorted(self.planned)]

    def describe(self) -> dict[str, Any]:
        """What `ready` and `/health` report about the shapes."""
        built = [[rows, tokens] for rows, tokens in self.stats.built]
        return {
            "cuda_graphs": self.graphs,
            "buckets": list(self.table.lengths),
            "shapes": len(self.static),
            "graph_shapes": sorted(built) if built else [list(s) for s in sorted(self.planned)],
            "captured_shapes": sorted(built) if self.graphs else [],
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

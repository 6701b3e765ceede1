"""LoRA adapters applied unmerged, per token, over one shared backbone.

Why unmerged: a clef-finetune variant is its base plus `scale * B @ A` on each adapted linear
layer (and its own head). Merging costs a whole backbone per variant; applying the low-rank
update on the fly costs two thin matmuls per layer, and lets requests of different variants
share one forward. `y = x W^T + scale * (x A^T) B^T` is what `clef-finetune merge` computes as
`(W + scale * B A)`, up to the order of float additions (tests/test_variants.py bounds it
against the reference on a fp32 merged release).

Every adapted `nn.Linear` of the text stack is replaced by an `AdaptedLinear` holding the base
layer and one `LoraWeights` per variant. Which variant each token belongs to is set once per
forward on the shared `AdapterSelection` (the runner knows the layout, the layers do not):

- **segments** (CPU, any eager forward): `(start, end, slot)` ranges of the flattened tokens;
  each range of a variant adds its own two matmuls, base ranges add nothing. A forward of base
  requests only costs one attribute check per layer.
- **stacked** (the CUDA design): every variant's A stacked along the rank into one `[R, in]`
  matrix and B into `[out, R]`, and a per-token slot index: `((x A^T) * mask) B^T` with
  `mask[t, c] = slot[t] == column_slot[c]`. Fixed shapes, no host reads and no branching on the
  index's values, so a CUDA graph can capture it with a static index buffer rewritten in place
  before each replay. Its logic runs on CPU in the tests.

Slot 0 is the base model (no adapter); variant `i` (in `--finetune` order) is slot `i + 1`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

SEGMENTS = "segments"
STACKED = "stacked"
BASE_SLOT = 0


@dataclass(frozen=True)
class LoraWeights:
    """One variant's update of one layer: A [r, in] and B already multiplied by the scale
    [out, r], on the layer's device and dtype."""

    a: Tensor
    scaled_b: Tensor


class AdapterSelection:
    """Which variant each token of the current forward belongs to, shared by every adapted
    layer of one backbone. Nothing selected (the default) means the base for every token."""

    def __init__(self, mode: str = SEGMENTS):
        if mode not in (SEGMENTS, STACKED):
            raise ValueError(f"unknown adapter mode {mode!r}")
        self.mode = mode
        self.segments: tuple[tuple[int, int, int], ...] = ()
        self.token_slots: Tensor | None = None
        self.static = False  # inside `replaying`: the stacked path, whatever the mode

    @property
    def stacked(self) -> bool:
        return self.mode == STACKED or self.static

    @contextmanager
    def replaying(self, slots: Tensor) -> Iterator[None]:
        """For a captured forward (clef_worker.serving.gpu.packed_graphs,
        clef_worker.serving.gpu.graphs): the
        stacked path over a static per-token slot buffer the caller rewrites in place before
        each replay, taken for every forward whatever the buffer holds (the capture records one
        code path). The selection in force before is restored after."""
        before = (self.static, self.token_slots, self.segments)
        self.static, self.token_slots, self.segments = True, slots, ((0, slots.shape[0], -1),)
        try:
            yield
        finally:
            self.static, self.token_slots, self.segments = before

    @contextmanager
    def using(self, slots: Sequence[int], spans: Sequence[tuple[int, int]],
              device: torch.device, tokens: int | None = None) -> Iterator[None]:
        """Select for one forward: `spans[i]` is where request i's tokens sit in the flattened
        forward (pad tokens between requests count as their row's); its slot is `slots[i]`.
        `tokens` is the forward's whole token count (default: the end of the last span): a
        padded forward's pad rows, beyond every request's span, are tokens of the forward too,
        and the stacked path's per-token index must cover them (as the base's)."""
        self.segments = merge_segments(slots, spans)
        if self.mode == STACKED and self.segments:
            total = tokens if tokens is not None else max(end for _, end in spans)
            self.token_slots = token_slots(self.segments, total).to(device)
        try:
            yield
        finally:
            self.segments = ()
            self.token_slots = None


def merge_segments(slots: Sequence[int], spans: Sequence[tuple[int, int]]
                   ) -> tuple[tuple[int, int, int], ...]:
    """The variant ranges of a forward, adjacent ranges of one variant joined, base ranges left
    out (they add nothing); empty when every request is the base's."""
    out: list[tuple[int, int, int]] = []
    for slot, (start, end) in sorted(zip(slots, spans, strict=True), key=lambda x: x[1][0]):
        if slot == BASE_SLOT or end <= start:
            continue
        if out and out[-1][2] == slot and out[-1][1] == start:
            out[-1] = (out[-1][0], end, slot)
        else:
            out.append((start, end, slot))
    return tuple(out)


def token_slots(segments: Sequence[tuple[int, int, int]], total: int) -> Tensor:
    """The per-token slot index of the stacked path (0 outside every segment)."""
    index = torch.zeros(total, dtype=torch.long)
    for start, end, slot in segments:
        index[start:end] = slot
    return index


class AdaptedLinear(nn.Module):
    """A base `nn.Linear` plus each variant's low-rank update, applied per token as the shared
    selection says. The base weight stays the one tensor it was (no copy)."""

    def __init__(self, base: nn.Linear, selection: AdapterSelection):
        super().__init__()
        self.base = base
        self.selection = selection
        self.adapters: dict[int, LoraWeights] = {}
        # The stacked form, rebuilt whenever an adapter is added.
        self.stacked_a: Tensor | None = None
        self.stacked_b: Tensor | None = None
        self.column_slots: Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> Tensor:
        return self.base.weight

    def add(self, slot: int, weights: LoraWeights) -> None:
        """Attach one variant's update (slots in any order; each once)."""
        if slot == BASE_SLOT or slot in self.adapters:
            raise ValueError(f"slot {slot} is the base or already attached")
        self.adapters[slot] = weights
        slots = sorted(self.adapters)
        self.stacked_a = torch.cat([self.adapters[s].a for s in slots])
        self.stacked_b = torch.cat([self.adapters[s].scaled_b for s in slots], dim=1)
        self.column_slots = torch.cat([
            torch.full((self.adapters[s].a.shape[0],), s, dtype=torch.long,
                       device=self.adapters[s].a.device) for s in slots])
        # Each variant's A and B become views into the stacked tensors: one copy in memory.
        start = 0
        for s in slots:
            rank = self.adapters[s].a.shape[0]
            self.adapters[s] = LoraWeights(self.stacked_a[start:start + rank],
                                           self.stacked_b[:, start:start + rank])
            start += rank

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.base.weight, self.base.bias)
        selection = self.selection
        if not selection.segments or not self.adapters:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.view(-1, y.shape[-1])
        if selection.stacked:
            return (flat_y + self.stacked_delta(flat_x, selection.token_slots)).view_as(y)
        for start, end, slot in selection.segments:
            weights = self.adapters.get(slot)
            if weights is None:
                continue
            part = flat_x[start:end]
            flat_y[start:end] += (part @ weights.a.T) @ weights.scaled_b.T
        return y

    def stacked_delta(self, flat_x: Tensor, slots: Tensor | None) -> Tensor:
        """Every token's update in three fixed-shape kernels (see the module docstring)."""
        assert self.stacked_a is not None and self.stacked_b is not None
        assert self.column_slots is not None and slots is not None
        if slots.shape[0] != flat_x.shape[0]:
            # A shape check, not a value read: free inside a capture, and a wrong-sized index
            # would score some tokens by another request's variant.
            raise ValueError(f"{slots.shape[0]} token slots for a forward of "
                             f"{flat_x.shape[0]} tokens")
        mask = (slots[:, None] == self.column_slots[None, :]).to(flat_x.dtype)
        return ((flat_x @ self.stacked_a.T) * mask) @ self.stacked_b.T


def adapt(model: nn.Module, names: Sequence[str], selection: AdapterSelection
          ) -> dict[str, AdaptedLinear]:
    """Replace the named `nn.Linear` submodules of `model` with `AdaptedLinear` wrappers (once;
    an already adapted layer is returned as it is)."""
    adapted: dict[str, AdaptedLinear] = {}
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child)
        if isinstance(layer, AdaptedLinear):
            adapted[name] = layer
            continue
        if not isinstance(layer, nn.Linear):
            raise TypeError(f"{name} is a {type(layer).__name__}, not a linear layer")
        wrapper = AdaptedLinear(layer, selection)
        setattr(parent, child, wrapper)
        adapted[name] = wrapper
    return adapted

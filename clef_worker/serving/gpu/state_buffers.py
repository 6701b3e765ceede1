"""The fixed-address state inputs every packed bucket's forward reads (clef_worker.model.stateful).

Why one set for all buckets: graphs replay one at a time on the worker's thread, so the recurrent
state rows, convolution tails and key/value buffers can be shared by every bucket. The index
buffers are each bucket's own (`RowIndex`, a few ints a token): a replay without a new fill
(warm-up's `replay_all`, a forced shape) must read indices made for its own row, never another
bucket's, which on CUDA would index past its rows. A plain group fills them as "fresh": zero
state rows (exactly the plain forward's start), each sequence's keys only its own (`fill`);
a group that continues cached prefixes or stores points writes its rows and cached keys
first (clef_worker.serving.prefix.graphed), then fills the indices with each sequence's cached
length and rotary start.

Sizes: `slots` is the static row's sequence count (`packed.static_sequences`: `max_sequences`,
the dummy tail and, in the buckets' dense row, the always-empty slot; those two keep zero rows,
and their final states are never stored); the key
buffers hold `capacity` rows, the largest bucket plus the cached keys a group may bring (a group
whose cached keys do not fit is split by the caller). At Clef-Flash's shapes a state row is
49 MiB over the 24 Gated DeltaNet layers, so 18 rows are 0.88 GiB; the key buffers 64 KiB per
token over the 8 attention layers (docs/operations.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from clef_worker.model.packed import PackedLayout, aligned_length, segmented_arange, to_device
from clef_worker.model.stateful import StateInputs


@dataclass(frozen=True)
class StateShapes:
    """The model's per-layer state dimensions."""

    linear_layers: int
    heads: int  # Gated DeltaNet value heads
    key_dim: int  # per head
    value_dim: int  # per head
    conv_width: int  # K
    conv_dim: int  # D
    attention_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: object) -> StateShapes:
        layers = list(model.layers[: model.config.num_hidden_layers])  # type: ignore[attr-defined]
        mixers = [layer.linear_attn for layer in layers if layer.block_type == "linear_attention"]
        attentions = [layer.self_attn for layer in layers
                      if layer.block_type != "linear_attention"]
        mixer = mixers[0]
        config = model.config  # type: ignore[attr-defined]
        return cls(
            linear_layers=len(mixers), heads=mixer.value_dim // mixer.head_v_dim,
            key_dim=mixer.head_k_dim, value_dim=mixer.head_v_dim,
            conv_width=mixer.conv1d.weight.shape[-1], conv_dim=mixer.conv1d.weight.shape[0],
            attention_layers=len(attentions), kv_heads=config.num_key_value_heads,
            head_dim=attentions[0].head_dim if attentions else 0)


@dataclass(frozen=True)
class RowSequence:
    """One sequence of a stateful row: its new tokens, where its rotary positions start, and
    how many cached keys precede them in the key buffers."""

    length: int
    position: int = 0
    prior_keys: int = 0


class RowIndex:
    """One bucket's index buffers (StateInputs' per-token and per-sequence indices)."""

    def __init__(self, tokens: int, slots: int, tails: int, device: torch.device):
        self.key_index = torch.zeros(tokens, dtype=torch.long, device=device)
        self.rotary_positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.key_offsets = torch.zeros(slots + 1, dtype=torch.int32, device=device)
        self.tail_index = torch.zeros(tails, dtype=torch.long, device=device)
        self.key_offsets_host: tuple[int, ...] = (0,) * (slots + 1)


class StateBuffers:
    """The shared state inputs (module docs)."""

    def __init__(self, shapes: StateShapes, slots: int, tokens: int, capacity: int,
                 device: torch.device, dtype: torch.dtype):
        if capacity < tokens:
            raise ValueError(f"key capacity {capacity} below the largest bucket {tokens}")
        self.shapes, self.slots, self.tokens, self.capacity = shapes, slots, tokens, capacity
        self.device = device
        s = shapes
        self.recurrent = torch.zeros(s.linear_layers, slots, s.heads, s.key_dim, s.value_dim,
                                     dtype=torch.float32, device=device)
        self.conv = torch.zeros(s.linear_layers, slots, s.conv_width - 1, s.conv_dim,
                                dtype=dtype, device=device)
        self.keys = torch.zeros(s.attention_layers, capacity, s.kv_heads, s.head_dim,
                                dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.indices: dict[int, RowIndex] = {}  # per bucket (tokens)
        self.dirty: set[int] = set()  # state rows holding something other than zeros

    def index(self, tokens: int) -> RowIndex:
        """A bucket's own index buffers (made on first use): each bucket keeps the indices of
        its last fill, so a replay of it without a new fill (warm-up's) reads its own rows."""
        if tokens not in self.indices:
            self.indices[tokens] = RowIndex(tokens, self.slots,
                                            self.slots * (self.shapes.conv_width - 1),
                                            self.device)
        return self.indices[tokens]

    def inputs(self, tokens: int) -> StateInputs:
        """A bucket's view of the buffers (same addresses for every call)."""
        index = self.index(tokens)
        return StateInputs(
            recurrent=list(self.recurrent.unbind(0)), conv=list(self.conv.unbind(0)),
            keys=list(self.keys.unbind(0)), values=list(self.values.unbind(0)),
            key_index=index.key_index[:], key_offsets=index.key_offsets[:],
            key_offsets_host=index.key_offsets_host, max_keys=self.capacity,
            rotary_positions=index.rotary_positions[:], tail_index=index.tail_index[:])

    def clear_rows(self) -> None:
        """Zero the state rows a previous group wrote (fresh sequences start from zero)."""
        for slot in sorted(self.dirty):
            self.recurrent[:, slot].zero_()
            self.conv[:, slot].zero_()
        self.dirty.clear()

    def fill(self, layout: PackedLayout, sequences: Sequence[RowSequence]) -> None:
        """Write the index buffers for a row laid out as `layout` (a static row: aligned real
        sequences, the dummy tail, empty slots), its real sequences continuing as
        `sequences` say; one non-blocking host-to-device copy."""
        offsets = layout.cu_seqlens_host
        if len(offsets) != self.slots + 1 or offsets[-1] > self.tokens:
            raise ValueError(f"a layout of {len(offsets) - 1} sequences and {offsets[-1]} "
                             f"tokens for buffers of {self.slots} and {self.tokens}")
        spans = np.diff(np.asarray(offsets, dtype=np.int64))
        prior = np.zeros(self.slots, dtype=np.int64)
        start = np.zeros(self.slots, dtype=np.int64)
        real = np.zeros(self.slots, dtype=np.int64)
        for slot, sequence in enumerate(sequences):
            prior[slot], start[slot], real[slot] = (sequence.prior_keys, sequence.position,
                                                     sequence.length)
        key_lengths = prior + spans
        key_offsets = np.concatenate([[0], np.cumsum(key_lengths)])
        if key_offsets[-1] > self.capacity:
            raise ValueError(f"{int(key_offsets[-1])} keys do not fit the key buffers' "
                             f"{self.capacity}")
        slot_of, within = segmented_arange(spans)
        key_index = key_offsets[slot_of] + prior[slot_of] + within
        positions = start[slot_of] + within
        width = self.shapes.conv_width - 1
        last = np.asarray(offsets[:-1], dtype=np.int64) + np.maximum(real, width) - width
        tail_index = (last[:, None] + np.arange(width)[None, :]).reshape(-1)
        tail_index = np.minimum(tail_index, max(int(offsets[-1]) - 1, 0))
        tokens = int(offsets[-1])
        index = self.index(tokens)
        host = np.concatenate([key_index, positions, key_offsets, tail_index]).astype(np.int64)
        staged = to_device(torch.from_numpy(host), self.device)
        index.key_index.copy_(staged[:tokens])
        index.rotary_positions.copy_(staged[tokens:2 * tokens])
        index.key_offsets.copy_(staged[2 * tokens:2 * tokens + self.slots + 1])
        index.tail_index.copy_(staged[2 * tokens + self.slots + 1:])
        index.key_offsets_host = tuple(int(k) for k in key_offsets)


def fresh(lengths: Sequence[int]) -> list[RowSequence]:
    """Sequences that continue nothing: positions from 0, no cached keys."""
    return [RowSequence(int(length)) for length in lengths]


def row_tokens(sequences: Sequence[RowSequence], align: int) -> int:
    """Tokens a static row needs for these sequences (each aligned)."""
    return sum(aligned_length(s.length, align) for s in sequences)

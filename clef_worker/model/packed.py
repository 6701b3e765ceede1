"""Packed rows: several requests' tokens as one sequence, with cumulative offsets.

Why packed: a padded batch computes every pad slot of every row (20-45 % of a mixed Clef batch);
a packed row holds only the rows' own tokens, `[T, hidden]`, and the layers that mix tokens are
told where each sequence starts (`cu_seqlens`, the FlashAttention convention also used by fla).
The per-layer rules (attention causal within a sequence, the Gated DeltaNet short convolution and
recurrent state restarting at every boundary) live in `clef_worker.model.packed_layers`; this
module owns only the layout, built once per batch and shared by every layer.

What a layout carries, and why each piece is precomputed here:

- `cu_seqlens` (int32 `[S+1]`, device): the offsets every varlen kernel reads (fla, FlashAttention);
  int32 because FlashAttention requires it and fla loads them as int32 anyway.
- `cu_seqlens_host`: the same offsets on the host, from the lengths the caller gave, never read
  back from the device. The CPU kernels loop over sequences with them; the runner reads each
  row's hidden states from them.
- `positions` (int64 `[T]`, device): each token's position in its own sequence: the rotary angle
  (restarting at 0 per sequence, as a separate forward numbers it) and the short convolution's
  boundary mask (a tap reaching back `j` tokens is live iff `position >= j`).
- `chunk_indices` (int32 `[N, 2]`, device): for each 64-token chunk of fla's kernels, its
  (sequence, chunk within the sequence). fla derives them from `cu_seqlens` on the host when not
  given (a device read, i.e. a sync, and no capture); computed here from the host lengths, they are
  handed to fla so its varlen path never reads the device.
- `max_seqlen`: the longest sequence, a host int FlashAttention sizes its grid by.

The device tensors travel in one host-to-device copy (one int64 staging tensor, pinned on CUDA,
copied without blocking, then cut and cast on the device), so building a layout never waits for
the device.

Static layouts for CUDA graphs (`StaticPackedLayout`): a graph replays fixed shapes and fixed
kernel grids, but fla's grid is its number of chunks, `sum(ceil(len_i / 64))`, which depends on
the mix of lengths, not only on the total. So in a static layout every sequence is right-padded
to a multiple of `align` (64, fla's chunk) and a dummy tail sequence fills the bucket: the chunk
count is then always `total_tokens / 64`, `cu_seqlens` always has `max_sequences + 2` entries
(unused slots are empty sequences at the end, which every kernel skips), `max_seqlen` is the
bucket, and one graph per total-token bucket replays for any mix of lengths. `fill(lengths)`
rewrites the buffers in place (host-to-device copies only). Right padding inside a sequence
changes nothing at its real tokens (the stack is causal), and the tail is a sequence of its own,
so it cannot reach them either (`tests/test_packed_forward.py`).

One trap, found reading fla's source: fla memoises its index helpers (`prepare_chunk_offsets`,
...) by the *identity* of the `cu_seqlens` tensor it is given (`fla.utils.tensor_cache`). A
buffer refilled in place and passed as the same Python object would get the offsets of an
earlier fill, eagerly; and a forward captured after a warm run with the same object would
record no computation of them at all, so every replay would keep the warm run's offsets. Two
defences: the fla path turns the memo off (`packed_layers.disable_fla_memo`), and
`StaticPackedLayout.fill()`/`layout()` hand out fresh views of the buffers (same memory, what a
graph reads on replay; a new object, what the memo compares).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

# fla's chunk: its varlen kernels work in chunks of this many tokens (chunk_size=64 default).
FLA_CHUNK = 64


def cumulative(lengths: Sequence[int]) -> tuple[int, ...]:
    """Offsets `[0, l0, l0+l1, ...]` of sequences of these lengths."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + int(length))
    return tuple(offsets)


def segmented_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of these sizes: each slot's segment and its index within the segment."""
    segment = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return segment, np.arange(len(segment)) - starts[segment]


def staged_values(offsets: Sequence[int], chunk: int = FLA_CHUNK,
                  capacity: int = 0) -> tuple[Tensor, int, int]:
    """The offsets, fla's chunk indices (flattened) and every token's position, back to back in
    one int64 host tensor; also the number of offsets and of chunk pairs. With a `capacity`
    above the chunk count, the pairs are padded to it with chunk 0 of the last sequence, which
    must be empty (each kernel masks a chunk past its sequence's end: the pair computes
    nothing). Vectorised in numpy: a layout is built on the request path, and torch's intra-op
    threads cost more than they save on arrays this small (30 ms instead of 0.3 ms for 16,384
    tokens on a busy 2-core host)."""
    cu = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(cu)
    sequence, within = segmented_arange((lengths + chunk - 1) // chunk)
    _, positions = segmented_arange(lengths)
    spare = max(0, capacity - len(sequence))
    if spare:
        if lengths[-1]:
            raise AssertionError("internal: spare chunk pairs need an empty last sequence")
        sequence = np.concatenate([sequence, np.full(spare, len(lengths) - 1)])
        within = np.concatenate([within, np.zeros(spare, dtype=within.dtype)])
    pairs = np.stack([sequence, within], 1).reshape(-1)
    host = np.concatenate([cu, pairs, positions]).astype(np.int64)
    return torch.from_numpy(host), len(cu), len(sequence)


def aligned_length(length: int, align: int) -> int:
    """`length` rounded up to a multiple of `align`."""
    return -(-length // align) * align


def check_lengths(lengths: Sequence[int]) -> None:
    if not lengths:
        raise ValueError("a packed row needs at least one sequence")
    if any(int(length) < 1 for length in lengths):
        raise ValueError(f"every packed sequence needs at least one token: {list(lengths)}")


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`: pinned and copied without blocking on CUDA, so the caller
    never waits for the device's queue (the caching host allocator keeps the pinned staging
    memory alive until the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence of a packed row starts and ends (cumulative offsets)."""

    cu_seqlens: Tensor  # int32 [S+1] on the model's device
    cu_seqlens_host: tuple[int, ...]  # the same offsets on the host (never read from the device)
    positions: Tensor  # int64 [T] on the device: each token's position in its sequence
    chunk_indices: Tensor  # int32 [chunks, 2] on the device: fla's (sequence, chunk) pairs
    max_seqlen: int  # the longest sequence (FlashAttention's grid bound)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device) -> PackedLayout:
        """The layout of sequences of these lengths, back to back, unpadded."""
        check_lengths(lengths)
        offsets = cumulative(lengths)
        return cls.from_offsets(offsets, device, max_seqlen=max(int(n) for n in lengths))

    @classmethod
    def from_offsets(cls, offsets: Sequence[int], device: torch.device,
                     max_seqlen: int) -> PackedLayout:
        """The layout for these cumulative offsets (empty sequences allowed)."""
        offsets = tuple(int(offset) for offset in offsets)
        host, count, chunks = staged_values(offsets)
        staged = to_device(host, device)
        return cls(
            cu_seqlens=staged[:count].to(torch.int32),
            cu_seqlens_host=offsets,
            positions=staged[count + 2 * chunks:],
            chunk_indices=staged[count:count + 2 * chunks].view(-1, 2).to(torch.int32),
            max_seqlen=int(max_seqlen),
        )

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    @property
    def num_sequences(self) -> int:
        """Sequences in the row, empty ones included (the size of fla's per-sequence grids)."""
        return len(self.cu_seqlens_host) - 1

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of every sequence, from the host offsets."""
        offsets = self.cu_seqlens_host
        return list(itertools.pairwise(offsets))


def static_sequences(max_sequences: int, align: int) -> int:
    """The sequences of a static row, empty ones included: the real ones, the dummy tail, and
    dense (`align=1`) one more, always empty, for the spare chunk pairs to point at. Anything
    sized per sequence (the state rows of clef_worker.serving.gpu.state_buffers) is sized by
    this."""
    return max_sequences + (2 if align == 1 else 1)


class StaticPackedLayout:
    """Buffers for a packed row of exactly `total_tokens` tokens with at most `max_sequences`
    sequences and a dummy tail sequence filling the bucket; `fill(lengths)` writes the offsets
    in place (host -> device copy only) so a captured graph replays with new offsets.

    Two ways to keep fla's grid fixed. `align` a multiple of fla's chunk (64): every sequence
    starts on a chunk, so the chunk count is always `total_tokens / 64` (a ~393-token request
    then takes 448 tokens). `align=1` (dense): sequences back to back, and the chunk pairs
    padded to `total_tokens / 64 + max_sequences` (each sequence adds at most one partial chunk)
    with pairs of an always-empty last slot, which compute nothing; only the Gated DeltaNet's
    chunked kernels see those extra chunks, every other layer runs the real tokens.

    Shapes that never change for a given (total_tokens, max_sequences, align): `cu_seqlens` has
    `max_sequences + 2` entries aligned, `+ 3` dense (the real sequences, the tail, then empty
    slots at the end), `chunk_indices` as above, `positions` has `total_tokens` entries,
    `max_seqlen` is `total_tokens`.
    """

    def __init__(self, total_tokens: int, max_sequences: int, device: torch.device,
                 align: int = FLA_CHUNK):
        if align != 1 and (align < FLA_CHUNK or align % FLA_CHUNK):
            raise ValueError(f"align {align}: must be 1 or a multiple of fla's chunk, "
                             f"{FLA_CHUNK}")
        unit = FLA_CHUNK if align == 1 else align
        if total_tokens < unit or total_tokens % unit:
            raise ValueError(f"total_tokens {total_tokens}: must be a positive multiple of "
                             f"{unit}")
        if max_sequences < 1:
            raise ValueError(f"max_sequences {max_sequences}: must be at least 1")
        self.total_tokens = total_tokens
        self.max_sequences = max_sequences
        self.align = align
        self.device = device
        dense = align == 1
        self.slots = static_sequences(max_sequences, align) + 1
        self.chunk_capacity = total_tokens // FLA_CHUNK + (max_sequences if dense else 0)
        self.cu_seqlens = torch.empty(self.slots, dtype=torch.int32, device=device)
        self.chunk_indices = torch.empty(self.chunk_capacity, 2, dtype=torch.int32,
                                         device=device)
        self.positions = torch.empty(total_tokens, dtype=torch.int64, device=device)
        self.cu_seqlens_host: tuple[int, ...] = ()
        # Before the first fill: one sequence spanning the bucket (a valid layout to warm with).
        self.fill([total_tokens])

    def offsets_for(self, lengths: Sequence[int]) -> tuple[int, ...]:
        """The static row's offsets for these real lengths: each aligned, then the tail, then
        empty slots; always `self.slots` entries ending at `total_tokens`."""
        check_lengths(lengths)
        if len(lengths) > self.max_sequences:
            raise ValueError(f"{len(lengths)} sequences do not fit a static row of at most "
                             f"{self.max_sequences}")
        offsets = cumulative([aligned_length(int(n), self.align) for n in lengths])
        if offsets[-1] > self.total_tokens:
            raise ValueError(f"lengths {list(lengths)} take {offsets[-1]} aligned tokens, more "
                             f"than the static row's {self.total_tokens}")
        return (*offsets, *([self.total_tokens] * (self.slots - len(offsets))))

    def fill(self, lengths: Sequence[int]) -> PackedLayout:
        """Write the offsets for these real lengths into the buffers (in place) and return the
        layout to run with: fresh views of the buffers (see the module docs on fla's memo)."""
        offsets = self.offsets_for(lengths)
        host, count, chunks = staged_values(offsets, capacity=self.chunk_capacity)
        if chunks != self.chunk_capacity:
            raise AssertionError(f"internal: {chunks} chunks in a static row of "
                                 f"{self.total_tokens} tokens")
        staged = to_device(host, self.device)
        self.cu_seqlens.copy_(staged[:count])
        self.chunk_indices.copy_(staged[count:count + 2 * chunks].view(-1, 2))
        self.positions.copy_(staged[count + 2 * chunks:])
        self.cu_seqlens_host = offsets
        return self.layout()

    def layout(self) -> PackedLayout:
        """The current contents as a layout: new tensor objects over the same buffers."""
        return PackedLayout(
            cu_seqlens=self.cu_seqlens[:],
            cu_seqlens_host=self.cu_seqlens_host,
            positions=self.positions[:],
            chunk_indices=self.chunk_indices[:],
            max_seqlen=self.total_tokens,
        )

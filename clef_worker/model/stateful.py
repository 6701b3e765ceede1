"""The packed forward with per-sequence initial states as inputs and final states as outputs.

Why: a request that continues a cached prefix (clef_worker.serving.prefix.cache) needs three things
a plain packed row does not give it, and each is an input of fixed shape, so the forward that
consumes them can be captured once per total-token bucket and replayed for any mix of fresh and
continuing requests (clef_worker.serving.gpu.packed_graphs):

- **Gated DeltaNet recurrent state**, per layer `[slots, Hv, dk, dv]` float32: the delta rule
  starts each sequence from its row (fla's `initial_state` with `cu_seqlens`). A fresh sequence's
  row is zero, which is exactly the plain forward's start. The final states come out
  (`output_final_state`): a sequence whose last token ends at a cached point (a multiple of 64,
  so no alignment padding follows it) ends with exactly the state to keep.
- **Short convolution tail**, per layer `[slots, K-1, D]`: the convolution inputs of the `K-1`
  tokens before each sequence's first; zero rows are the zero padding a fresh sequence has. The
  tails at each sequence's end are read back with a fixed index (`tail_index`).
- **Attention keys and values**, per layer, in one buffer `[capacity, Hkv, d]` holding every
  sequence's cached keys followed by its new ones: the forward writes the new keys at
  `key_index` and attends with separate query and key offsets (causal, aligned at the end: a
  new token sees every cached key). Rotary positions are inputs too (`rotary_positions`), so a
  continuing sequence's positions go on from its cached length (and its media rotary offset).

Nothing here reads a device value on the host: every offset a kernel needs arrives as a device
tensor the caller filled with a non-blocking copy (`StateInputs`), plus host-side copies the
per-sequence CPU kernels loop over (they never run under capture).

There is one packed forward (clef_worker.model.packed_layers.packed_forward) and one kernel set
(clef_worker.model.packed_kernels, the fused elementwise ops included): this module only names
the state inputs and outputs; `packed_layers.stateful_forward` runs that forward with them.
Zero state rows and each sequence's keys only its own are exactly the plain forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class StateInputs:
    """One forward's state inputs and the indices that place them (see the module docs).

    Host copies (`*_host`) are for the per-sequence CPU kernels only; the device tensors are
    what a captured graph reads."""

    recurrent: list[Tensor]  # per Gated DeltaNet layer: [slots, Hv, dk, dv] float32
    conv: list[Tensor]  # per Gated DeltaNet layer: [slots, K-1, D]
    keys: list[Tensor]  # per attention layer: [capacity, Hkv, d]
    values: list[Tensor]  # per attention layer: [capacity, Hkv, d]
    key_index: Tensor  # int64 [T]: each row's place in the key buffers
    key_offsets: Tensor  # int32 [slots + 1]: where each sequence's keys start and end
    key_offsets_host: tuple[int, ...]
    max_keys: int  # the longest key sequence's bound (FlashAttention's grid)
    rotary_positions: Tensor  # int64 [T]
    tail_index: Tensor  # int64 [slots * (K-1)]: the rows whose conv inputs end each sequence


@dataclass
class StateOutputs:
    """What a forward leaves for the next round or the cache, per Gated DeltaNet layer: each
    sequence's final recurrent state `[slots, Hv, dk, dv]` and its last `K-1` convolution inputs
    `[slots, K-1, D]` (meaningful for sequences with at least `K-1` tokens)."""

    recurrent: list[Tensor]
    conv: list[Tensor]


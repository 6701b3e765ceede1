"""The Qwen3.5 text stack over a packed row: every layer, with the sequence boundaries respected.

Why clef runs its own layer loop instead of handing transformers packed kwargs: transformers'
Qwen3.5 modelling passes its varlen kwargs to the Gated DeltaNet kernel but not in a form its
torch short convolution honours (the convolution then runs across boundaries: the packed-sample
leak), and its CUDA-graph behaviour depends on mask heuristics (clef_worker.model.backbone,
`NO_MASKS`). The loop below reuses the loaded modules' weights and submodules (norms,
projections, MLP, rotary table) and replaces only what mixes tokens:

- **Norms, projections, MLP, the gated RMS norm**: over the whole `[1, T, hidden]` row at once.
  No pad token is computed, which is where packing beats padded batching.
- **Rotary positions**: `layout.positions` (restarting at 0 for each sequence) as the text
  position ids. Qwen3.5's text rotary is multimodal (three axes interleaved), and for text every
  axis carries the same position, as transformers builds them from `position_ids`; passing the
  `[1, T]` positions gives exactly that.
- **Full attention** (causal within a sequence, nothing across): `varlen_attn` on CUDA in
  bfloat16/float16 (`torch.nn.attention.varlen`, FlashAttention with `cu_seqlens`, causal through
  `window_size=(-1, 0)`); elsewhere one call per sequence of the attention function transformers
  is configured with (SDPA on CPU), the same arithmetic as a separate forward.
- **Short convolution** (restarts at every boundary): fla's Triton `causal_conv1d` with
  `cu_seqlens` and `chunk_indices` on the fla path; on the fla path with `--short-conv torch`, a
  masked depthwise convolution over the whole row: the tap reaching back `j` tokens is zeroed
  where `position < j`, so no token sees the previous sequence (no host reads: it runs under
  capture too); elsewhere (CPU) one call per sequence of transformers' bound function.
- **Gated delta rule** (the recurrent state restarts at every boundary): fla's
  `chunk_gated_delta_rule` with `cu_seqlens` and precomputed `chunk_indices` (batch of one row,
  no initial state, so each sequence starts from zero) on the fla path; elsewhere one call per
  sequence of the kernel transformers' module has bound (clef's small-chunk kernel on CPU).

The kernels live in clef_worker.model.packed_kernels, where each also takes per-sequence
initial states: this one forward is the plain packed forward (no state inputs: every sequence
from zero) and the stateful one the buckets capture (clef_worker.model.stateful: recurrent rows,
convolution tails and cached keys as inputs, final states out), so the layer arithmetic has one
copy. `PackedKernels` names the choice; `kernels_for` makes it from the loaded backbone. A
kernel set is `graph_safe` when nothing in it reads offsets on the host (the fla path with
`varlen_attn`): only then can one graph per total-token bucket replay with new offsets
(`clef_worker.model.packed.StaticPackedLayout`). The per-sequence paths read `cu_seqlens_host`
and are for eager forwards (CPU).

**The CUDA branch has not run on a GPU yet.** On CPU its argument building is tested with fakes
standing in for fla and `varlen_attn` (`tests/test_packed_forward.py`), and its fla calls run
fla's real kernels under Triton's interpreter against the per-sequence torch path
(`tests/test_packed_fla_interpreter.py`); `varlen_attn` itself is CUDA-only and untested here.
The worker's start-up self-check compares this path with the eager one on every device before
it serves (`clef_worker/starting/self_check.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from clef_worker.model.fused import TORCH, FusedOps
from clef_worker.model.packed import PackedLayout
from clef_worker.model.packed_kernels import KeySpans
from clef_worker.model.packed_kernels import PackedKernels as PackedKernels
from clef_worker.model.packed_kernels import kernels_for as kernels_for
from clef_worker.model.stateful import StateInputs, StateOutputs

# -------------------------------------------------------------------------------------------
# The layers


def gated_delta_net(mixer: Any, x: Tensor, layout: PackedLayout, kernels: PackedKernels,
                    states: StateInputs | None = None, layer: int = 0,
                    out: StateOutputs | None = None) -> Tensor:
    """transformers' `Qwen3_5GatedDeltaNet.forward` (no cache) over a packed row; with
    `states`, each sequence from its convolution tail and recurrent state row (layer `layer`),
    its final ones appended to `out`."""
    rows, length, _ = x.shape
    mixed = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(rows, length, -1, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)
    tail = initial = None
    if states is not None:
        tail, initial = states.conv[layer], states.recurrent[layer]
        if out is not None:  # the convolution inputs each sequence ends with
            out.conv.append(mixed[0].index_select(0, states.tail_index).view(tail.shape))
    mixed = kernels.conv(mixed, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                         mixer.activation, layout, tail)
    query, key, value, g, beta = delta_rule_inputs(mixer, mixed, a, b, rows, length,
                                                   kernels.fused)
    core, final = kernels.delta_rule(query, key, value, g, beta, layout, initial)
    if out is not None and final is not None:
        out.recurrent.append(final)
    core = kernels.fused.gated_norm(mixer.norm, core.reshape(-1, mixer.head_v_dim),
                                    z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(rows, length, -1))


def full_attention(module: Any, x: Tensor, rotary: tuple[Tensor, Tensor], layout: PackedLayout,
                   kernels: PackedKernels, states: StateInputs | None = None,
                   layer: int = 0) -> Tensor:
    """transformers' `Qwen3_5Attention.forward` (no cache) over a packed row; with `states`,
    each sequence attending to its cached keys too: the new keys and values are written into
    the key buffers (layer `layer`) first, at `key_index`."""
    query, key, value, gate = attention_inputs(module, x, rotary, kernels.fused)
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, d]
    spans = KeySpans.of(layout)
    if states is not None:
        keys, values = states.keys[layer], states.values[layer]
        keys.index_copy_(0, states.key_index, key.to(keys.dtype))
        values.index_copy_(0, states.key_index, value.to(values.dtype))
        key, value = keys, values
        spans = KeySpans(states.key_offsets, states.key_offsets_host, states.max_keys)
    return attention_output(module, kernels.attention(module, query, key, value, layout, spans),
                            gate, kernels.fused)


def delta_rule_inputs(mixer: Any, mixed: Tensor, a: Tensor, b: Tensor, rows: int, length: int,
                      fused: FusedOps = TORCH) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The Gated DeltaNet rule's inputs from the convolved projection and the gate
    projections: query, key, value (`[rows, length, heads, dim]`), the decay `g` and `beta`.
    One copy for the packed forward and the prefixed one (clef_worker.model.prefix_forward),
    whose recurrent states must be the ones a whole forward makes."""
    query, key, value = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim],
                                    dim=-1)
    query = query.reshape(rows, length, -1, mixer.head_k_dim)
    key = key.reshape(rows, length, -1, mixer.head_k_dim)
    value = value.reshape(rows, length, -1, mixer.head_v_dim)
    return query, key, value, fused.decay(mixer, a), b.sigmoid()


def attention_inputs(module: Any, x: Tensor, rotary: tuple[Tensor, Tensor],
                     fused: FusedOps = TORCH) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The first half of transformers' `Qwen3_5Attention.forward`: the query, key and value
    (`[rows, heads, tokens, head_dim]`, normed, rotated) and the output gate
    (`[rows, tokens, heads * head_dim]`). One copy for the packed forward and the prefixed
    one (clef_worker.model.prefix_forward), whose keys must be the ones a whole forward makes."""
    input_shape = x.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query, gate = torch.chunk(
        module.q_proj(x).view(*input_shape, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query, _ = fused.norm(module.q_norm, query.view(hidden_shape), None)
    key, _ = fused.norm(module.k_norm, module.k_proj(x).view(hidden_shape), None)
    query, key = fused.rotate(query, key, rotary)  # `[rows, tokens, heads, head_dim]`
    value = module.v_proj(x).view(hidden_shape).transpose(1, 2)
    return query.transpose(1, 2), key.transpose(1, 2), value, gate


def attention_output(module: Any, output: Tensor, gate: Tensor,
                     fused: FusedOps = TORCH) -> Tensor:
    """The second half: the attention output (`[rows, tokens, heads, head_dim]`) gated and
    projected back to the hidden size."""
    return module.o_proj(fused.output_gate(output.reshape(*gate.shape[:-1], -1), gate))


def packed_forward(model: Any, input_ids: Tensor, layout: PackedLayout, kernels: PackedKernels,
                   states: StateInputs | None = None, out: StateOutputs | None = None) -> Tensor:
    """Last hidden state (after the final norm) of a packed row: [T] ids -> [T, hidden].
    With `states`, each sequence continues from its state inputs (rotary positions too) and
    its final states go to `out` (clef_worker.model.stateful); without, every sequence starts
    from zero, which is the same forward with zero states."""
    if input_ids.dim() != 1 or input_ids.shape[0] != layout.total_tokens:
        raise ValueError(f"packed input_ids must be [{layout.total_tokens}] (the layout's "
                         f"tokens), got {list(input_ids.shape)}")
    fused = kernels.fused
    hidden = model.embed_tokens(input_ids).unsqueeze(0)
    positions = layout.positions if states is None else states.rotary_positions
    rotary = fused.rotary_table(model.rotary_emb, hidden, positions)
    linear = attention = 0
    # Each residual add is done by the norm that follows it (`fused.norm(module, update,
    # residual)` returns the normed sum and the sum): one kernel on the fla path.
    update: Tensor | None = None
    for layer in model.layers[: model.config.num_hidden_layers]:
        mixed, hidden = add_norm(fused, layer.input_layernorm, hidden, update)
        if layer.block_type == "linear_attention":
            update = gated_delta_net(layer.linear_attn, mixed, layout, kernels, states, linear,
                                     out)
            linear += 1
        else:
            update = full_attention(layer.self_attn, mixed, rotary, layout, kernels, states,
                                    attention)
            attention += 1
        mixed, hidden = fused.norm(layer.post_attention_layernorm, update, hidden)
        update = fused.mlp(layer.mlp, mixed)
    normed, _ = add_norm(fused, model.norm, hidden, update)
    return normed[0]


def stateful_forward(model: Any, input_ids: Tensor, layout: PackedLayout, kernels: PackedKernels,
                     states: StateInputs) -> tuple[Tensor, StateOutputs]:
    """The packed forward each sequence continuing from its state inputs, `[T]` ids ->
    `[T, H]`; and the final states (clef_worker.model.stateful). What every packed bucket
    captures (clef_worker.serving.gpu.packed_graphs)."""
    out = StateOutputs([], [])
    return packed_forward(model, input_ids, layout, kernels, states, out), out


def add_norm(fused: FusedOps, module: Any, hidden: Tensor,
             update: Tensor | None) -> tuple[Tensor, Tensor]:
    """`(module(hidden + update), hidden + update)`; before the first layer there is no
    update yet."""
    if update is None:
        return fused.norm(module, hidden, None)
    return fused.norm(module, update, hidden)

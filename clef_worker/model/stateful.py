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
per-sequence CPU kernels loop over (they never run under capture). The kernels are chosen as for
the plain packed forward (`stateful_kernels_for`): fla's varlen kernels and `varlen_attn` on the
fla path, per-sequence PyTorch elsewhere, which is what `--cuda-graphs on` runs on CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from clef_worker.model import gated_delta, short_conv
from clef_worker.model.module_names import FLA_KERNEL_MODULE
from clef_worker.model.packed import PackedLayout
from clef_worker.model.packed_layers import (
    CAUSAL_WINDOW,
    accepts,
    attention_inputs,
    attention_output,
    delta_rule_inputs,
    disable_fla_memo,
    fla_index_kwargs,
    load_varlen_attention,
    modeling_module,
)


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
    `[slots, K-1, D]` (meaningful for sequences with at least `K-1` tokens and no padding)."""

    recurrent: list[Tensor]
    conv: list[Tensor]


class StateDeltaRule(Protocol):
    def __call__(self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                 initial: Tensor, layout: PackedLayout) -> tuple[Tensor, Tensor]: ...


class StateConv(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                 tail: Tensor, layout: PackedLayout) -> Tensor: ...


class StateAttention(Protocol):
    def __call__(self, module: Any, query: Tensor, keys: Tensor, values: Tensor,
                 layout: PackedLayout, states: StateInputs) -> Tensor: ...


@dataclass(frozen=True)
class StateKernels:
    """The sequence-mixing parts of the stateful forward."""

    delta_rule: StateDeltaRule  # -> (output [1, T, Hv, dv], final states [slots, Hv, dk, dv])
    conv: StateConv  # x [1, T, D] -> [1, T, D], activation applied
    attention: StateAttention  # q [1, Hq, T, d] over the key buffers -> [1, T, Hq, d]
    names: tuple[str, str, str]
    graph_safe: bool


# -------------------------------------------------------------------------------------------
# Per-sequence kernels (CPU, and wherever the packed kernels loop): host offsets, never captured


def looped_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                      initial: Tensor, layout: PackedLayout) -> tuple[Tensor, Tensor]:
    """The bound kernel (clef's chunked rule on CPU) per sequence, from its state row."""
    kernel = getattr(modeling_module(), gated_delta.KERNEL_NAME)
    outputs, finals = [], initial.clone()
    for slot, (start, end) in enumerate(layout.spans()):
        if end == start:
            continue
        span = slice(start, end)
        output, final = kernel(query[:, span], key[:, span], value[:, span], g=g[:, span],
                               beta=beta[:, span], initial_state=initial[slot:slot + 1],
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
        outputs.append(output)
        finals[slot] = final[0].to(finals.dtype)
    return torch.cat(outputs, dim=1), finals


def looped_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                tail: Tensor, layout: PackedLayout) -> Tensor:
    """Per sequence, the bound convolution over its tail then its rows; the tail's own outputs
    dropped. A zero tail is the zero padding the plain forward convolves with: the same
    answer."""
    kernel = getattr(modeling_module(), short_conv.FUNCTION_NAME)
    width = tail.shape[1]
    outputs = []
    for slot, (start, end) in enumerate(layout.spans()):
        if end == start:
            continue
        rows = torch.cat([tail[slot].to(x.dtype), x[0, start:end]])
        out = kernel(rows.T.unsqueeze(0), weight, bias, activation=activation)
        outputs.append(out.transpose(1, 2)[:, width:])
    return torch.cat(outputs, dim=1)


def looped_attention(module: Any, query: Tensor, keys: Tensor, values: Tensor,
                     layout: PackedLayout, states: StateInputs) -> Tensor:
    """Per sequence, its queries over its keys (cached, then new): causal, aligned at the end."""
    from clef_worker.model.prefix_forward import attend

    outputs = []
    key_spans = list(zip(states.key_offsets_host, states.key_offsets_host[1:], strict=False))
    for (start, end), (first, last) in zip(layout.spans(), key_spans, strict=True):
        if end == start:
            continue
        outputs.append(attend(module, query[:, :, start:end],
                              keys[first:last].transpose(0, 1).unsqueeze(0),
                              values[first:last].transpose(0, 1).unsqueeze(0)))
    return torch.cat(outputs, dim=1)


LOOPED = StateKernels(looped_delta_rule, looped_conv, looped_attention,
                      ("per-sequence", "per-sequence", "per-sequence"), graph_safe=False)


# -------------------------------------------------------------------------------------------
# fla and varlen_attn (CUDA): device offsets only


def fla_delta_rule(kernel: Callable[..., Any]) -> StateDeltaRule:
    """fla's varlen `chunk_gated_delta_rule` from the state rows, final states out."""

    def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                   initial: Tensor, layout: PackedLayout) -> tuple[Tensor, Tensor]:
        output, final = kernel(query, key, value, g=g, beta=beta, initial_state=initial,
                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                               cu_seqlens=layout.cu_seqlens, **fla_index_kwargs(kernel, layout))
        return output, final

    return delta_rule


def fla_conv(kernel: Callable[..., Any]) -> StateConv:
    """fla's varlen `causal_conv1d` with the tails as its initial state (`[N, D, K]`, the last
    `K-1` columns the inputs before the sequence; the first is never read by a `K`-tap
    filter)."""

    def conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             tail: Tensor, layout: PackedLayout) -> Tensor:
        rows = x.to(weight.dtype)
        initial = torch.cat([tail.new_zeros(tail.shape[0], 1, tail.shape[2]), tail],
                            dim=1).transpose(1, 2).to(rows.dtype).contiguous()
        result = kernel(x=rows, weight=weight, bias=bias, activation=activation,
                        initial_state=initial, backend="triton", cu_seqlens=layout.cu_seqlens,
                        **fla_index_kwargs(kernel, layout))
        output = result[0] if isinstance(result, tuple) else result
        return output.to(x.dtype)

    return conv


def varlen_attention(kernel: Callable[..., Any]) -> StateAttention:
    """`varlen_attn` with the query row's offsets and the key buffers' own: FlashAttention's
    causal mask is aligned at the end when a sequence has more keys than queries, so query `i`
    of a sequence with `c` cached keys sees keys `[0, c + i]`."""
    has_gqa = accepts(kernel, "enable_gqa")
    has_scale = accepts(kernel, "scale")

    def attention(module: Any, query: Tensor, keys: Tensor, values: Tensor,
                  layout: PackedLayout, states: StateInputs) -> Tensor:
        q = query[0].transpose(0, 1).contiguous()
        k, v = keys, values
        groups = q.shape[1] // k.shape[1]
        extra: dict[str, Any] = {"window_size": CAUSAL_WINDOW}
        if groups > 1 and has_gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if has_scale:
            extra["scale"] = module.scaling
        elif module.scaling != q.shape[-1] ** -0.5:
            q = q * (module.scaling * q.shape[-1] ** 0.5)
        output = kernel(q, k, v, layout.cu_seqlens, states.key_offsets, layout.max_seqlen,
                        states.max_keys, **extra)
        return output.unsqueeze(0)

    return attention


def stateful_kernels_for(device: torch.device, dtype: torch.dtype,
                         gdn_path: str) -> StateKernels:
    """fla's kernels and `varlen_attn` on the fla path (graph-safe when fla takes chunk indices
    and `varlen_attn` runs here, with the window keyword); the per-sequence kernels elsewhere."""
    if gdn_path != "fla":
        return LOOPED
    delta = importlib.import_module(FLA_KERNEL_MODULE).chunk_gated_delta_rule
    disable_fla_memo()
    adapter = short_conv.installed(modeling_module())
    conv_kernel = adapter.kernel if adapter is not None else None
    attention_kernel = load_varlen_attention(device, dtype)
    graph_safe = (accepts(delta, "chunk_indices") and conv_kernel is not None
                  and accepts(conv_kernel, "chunk_indices") and attention_kernel is not None
                  and accepts(attention_kernel, "window_size"))
    return StateKernels(
        delta_rule=fla_delta_rule(delta),
        conv=fla_conv(conv_kernel) if conv_kernel is not None else looped_conv,
        attention=(varlen_attention(attention_kernel) if attention_kernel is not None
                   and accepts(attention_kernel, "window_size") else looped_attention),
        names=("fla-varlen", "fla-varlen" if conv_kernel is not None else "per-sequence",
               "varlen_attn" if attention_kernel is not None else "per-sequence"),
        graph_safe=graph_safe)


# -------------------------------------------------------------------------------------------
# The forward


def gated_delta_net(mixer: Any, x: Tensor, layout: PackedLayout, kernels: StateKernels,
                    states: StateInputs, layer: int, out: StateOutputs) -> Tensor:
    """transformers' `Qwen3_5GatedDeltaNet.forward` over a packed row, each sequence from its
    convolution tail and recurrent state; its final ones appended to `out`."""
    rows, length, _ = x.shape
    mixed = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(rows, length, -1, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)
    tail = states.conv[layer]
    out.conv.append(mixed[0].index_select(0, states.tail_index).view(tail.shape))
    mixed = kernels.conv(mixed, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                         mixer.activation, tail, layout)
    query, key, value, g, beta = delta_rule_inputs(mixer, mixed, a, b, rows, length)
    core, final = kernels.delta_rule(query, key, value, g, beta, states.recurrent[layer], layout)
    out.recurrent.append(final)
    core = mixer.norm(core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(rows, length, -1))


def full_attention(module: Any, x: Tensor, rotary: tuple[Tensor, Tensor], layout: PackedLayout,
                   kernels: StateKernels, states: StateInputs, layer: int) -> Tensor:
    """transformers' `Qwen3_5Attention.forward` over a packed row, each sequence attending to
    its cached keys too: the new keys and values are written into the buffers first."""
    query, key, value, gate = attention_inputs(module, x, rotary)
    keys, values = states.keys[layer], states.values[layer]
    keys.index_copy_(0, states.key_index, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, states.key_index, value[0].transpose(0, 1).to(values.dtype))
    output = kernels.attention(module, query, keys, values, layout, states)
    return attention_output(module, output, gate)


def stateful_forward(model: Any, input_ids: Tensor, layout: PackedLayout, kernels: StateKernels,
                     states: StateInputs) -> tuple[Tensor, StateOutputs]:
    """Last hidden state (after the final norm) of a packed row, `[T]` ids -> `[T, H]`, each
    sequence continuing from its state inputs; and the final states (`StateOutputs`)."""
    if input_ids.dim() != 1 or input_ids.shape[0] != layout.total_tokens:
        raise ValueError(f"packed input_ids must be [{layout.total_tokens}] (the layout's "
                         f"tokens), got {list(input_ids.shape)}")
    out = StateOutputs([], [])
    hidden = model.embed_tokens(input_ids).unsqueeze(0)
    rotary = model.rotary_emb(hidden, states.rotary_positions.unsqueeze(0))
    linear = attention = 0
    for layer in model.layers[: model.config.num_hidden_layers]:
        residual = hidden
        mixed = layer.input_layernorm(hidden)
        if layer.block_type == "linear_attention":
            mixed = gated_delta_net(layer.linear_attn, mixed, layout, kernels, states, linear,
                                    out)
            linear += 1
        else:
            mixed = full_attention(layer.self_attn, mixed, rotary, layout, kernels, states,
                                   attention)
            attention += 1
        hidden = residual + mixed
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.norm(hidden)[0], out

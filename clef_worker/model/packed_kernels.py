"""The sequence-mixing kernels of the packed forward (clef_worker.model.packed_layers), each
able to start every sequence from a state: one kernel set for plain rows and for rows that
continue cached prefixes.

Why one set: a fresh sequence is a sequence whose states are zero, so the plain packed forward is
the stateful one with no state inputs, and one copy of each kernel serves both (a captured bucket
replays either). What each part takes beyond the plain row:

- **Gated delta rule**: `initial`, per-sequence recurrent state rows `[slots, Hv, dk, dv]`
  (fla's `initial_state` with `cu_seqlens`); the final states come back with them. None: every
  sequence from zero and no final states (the plain forward's call, unchanged).
- **Short convolution**: `tail`, per sequence the `K-1` inputs before its first token
  (`[slots, K-1, D]`); zero rows are the zero padding a fresh sequence has.
- **Attention**: the keys and values `[Tk, Hkv, d]` with their own offsets (`KeySpans`): the
  row's own for a plain forward, the key buffers (cached keys then the new ones, per sequence)
  for a stateful one. Causal, aligned at the end: a new token sees every cached key.

The choice (`kernels_for`): fla's varlen kernels and `varlen_attn` on the fla path, one call
per sequence of transformers' bound functions elsewhere (CPU). A set is `graph_safe` when nothing
in it reads offsets on the host, and `state_safe` when, besides, its attention takes separate
query and key offsets with an end-aligned causal mask (`window_size`), so state inputs can be
captured too.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.nn import functional as F

from clef_worker.model import gated_delta, short_conv
from clef_worker.model.fused import TORCH, FusedOps, fused_ops_for
from clef_worker.model.module_names import FLA_KERNEL_MODULE, MODELING_MODULE
from clef_worker.model.packed import PackedLayout

log = logging.getLogger(__name__)

# FlashAttention's causal mask as varlen_attn spells it: no limit left, none right of the diagonal.
CAUSAL_WINDOW = (-1, 0)
VARLEN_DTYPES = (torch.bfloat16, torch.float16)
VARLEN_MODULE = "torch.nn.attention.varlen"


class KeySpans(NamedTuple):
    """Where each sequence's keys are in the keys an attention call gets."""

    offsets: Tensor  # int32 [S+1] on the device
    host: tuple[int, ...]  # the same on the host (the per-sequence kernels loop over them)
    max_keys: int  # the longest key sequence's bound (FlashAttention's grid)

    @classmethod
    def of(cls, layout: PackedLayout) -> KeySpans:
        """A plain row's: each sequence's keys are its own tokens."""
        return cls(layout.cu_seqlens, layout.cu_seqlens_host, layout.max_seqlen)


class DeltaRule(Protocol):
    def __call__(self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                 layout: PackedLayout, initial: Tensor | None = None
                 ) -> tuple[Tensor, Tensor | None]: ...


class ShortConv(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                 layout: PackedLayout, tail: Tensor | None = None) -> Tensor: ...


class Attention(Protocol):
    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 layout: PackedLayout, keys: KeySpans) -> Tensor: ...


@dataclass(frozen=True)
class PackedKernels:
    """The implementation of each sequence-mixing part of a packed forward."""

    # q, k [1, T, Hk, dk], v [1, T, Hv, dv], g, beta [1, T, Hv] -> [1, T, Hv, dv] and the
    # final states [slots, Hv, dk, dv] when initial ones were given
    delta_rule: DeltaRule
    conv: ShortConv  # x [1, T, D], weight [D, K] -> [1, T, D] (activation applied)
    attention: Attention  # q [1, Hq, T, d], k, v [Tk, Hkv, d] -> [1, T, Hq, d]
    names: tuple[str, str, str]  # (delta rule, conv, attention), for logs and `ready`
    graph_safe: bool  # no host read of offsets anywhere: one graph per bucket can replay
    # The norms, rotary, gates and MLP activation (clef_worker.model.fused): fla's fused
    # kernels on the fla path, the modules' own ops otherwise.
    fused: FusedOps = TORCH
    # graph_safe, and the attention takes keys with their own offsets end-aligned: the
    # state inputs (clef_worker.model.stateful) can be captured as well.
    state_safe: bool = False


# -------------------------------------------------------------------------------------------
# Gated delta rule


def modeling_module() -> Any:
    return importlib.import_module(MODELING_MODULE)


def looped_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                      layout: PackedLayout, initial: Tensor | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """One call per sequence of the kernel transformers' module has bound now (clef's
    small-chunk kernel on CPU), each from its state row (zero without `initial`: the separate
    forward's arithmetic, unchanged)."""
    kernel = getattr(modeling_module(), gated_delta.KERNEL_NAME)
    outputs = []
    finals = None if initial is None else initial.clone()
    for slot, (start, end) in enumerate(layout.spans()):
        if end == start:
            continue
        span = slice(start, end)
        output, final = kernel(
            query[:, span], key[:, span], value[:, span], g=g[:, span], beta=beta[:, span],
            initial_state=None if initial is None else initial[slot:slot + 1],
            output_final_state=finals is not None, use_qk_l2norm_in_kernel=True)
        outputs.append(output)
        if finals is not None:
            finals[slot] = final[0].to(finals.dtype)
    return torch.cat(outputs, dim=1), finals


def accepts(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` has a parameter `name` (a `**kwargs` catch-all does not count)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def fla_index_kwargs(kernel: Callable[..., Any], layout: PackedLayout) -> dict[str, Any]:
    """The precomputed indices an fla varlen kernel takes: `chunk_indices` (fla-core >= 0.5.1's
    signatures; nothing read on the host), else `cu_seqlens_cpu` (0.5.0: fla then builds the
    indices on the host and copies them: eager only, not capturable)."""
    if accepts(kernel, "chunk_indices"):
        return {"chunk_indices": layout.chunk_indices}
    return {"cu_seqlens_cpu": torch.tensor(layout.cu_seqlens_host, dtype=torch.int64)}


def fla_delta_rule(kernel: Callable[..., Any]) -> DeltaRule:
    """fla's `chunk_gated_delta_rule` over the packed row: batch of one, `cu_seqlens`, each
    sequence from its state row and its final state out; without `initial`, from zero and no
    final states (the plain forward's call)."""

    def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                   layout: PackedLayout, initial: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None]:
        output, final = kernel(query, key, value, g=g, beta=beta, initial_state=initial,
                               output_final_state=initial is not None,
                               use_qk_l2norm_in_kernel=True, cu_seqlens=layout.cu_seqlens,
                               **fla_index_kwargs(kernel, layout))
        return output, final if initial is not None else None

    return delta_rule


# -------------------------------------------------------------------------------------------
# Short convolution


def activate(x: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return x
    from transformers.activations import ACT2FN

    return ACT2FN[activation](x)


def masked_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                layout: PackedLayout, tail: Tensor | None = None) -> Tensor:
    """The causal depthwise convolution over the whole row, each tap masked at the boundaries:
    out[t] = sum_j w[K-1-j] x[t-j] over the j <= position[t] (the taps inside t's sequence);
    with a `tail`, a tap before its sequence reads the sequence's tail row instead of zero
    (each token's slot found on the device: no host read)."""
    dtype = x.dtype
    rows = x.to(weight.dtype)
    width = weight.shape[-1]
    length = rows.shape[1]
    output = rows * weight[:, width - 1]
    slot = None
    if tail is not None:
        tokens = torch.arange(length, dtype=layout.cu_seqlens.dtype, device=rows.device)
        slot = torch.searchsorted(layout.cu_seqlens, tokens, right=True) - 1
    for back in range(1, width):
        shifted = F.pad(rows, (0, 0, back, 0))[:, :length]  # x[t - back]
        live = (layout.positions >= back).unsqueeze(-1)  # [T, 1]
        before: Tensor | float = 0.0
        if tail is not None and slot is not None:  # row K-1+p-back of the tail
            row = (layout.positions + width - 1 - back).clamp(0, width - 2)
            before = tail[slot, row].to(rows.dtype).unsqueeze(0)
        output = output + torch.where(live, shifted, before) * weight[:, width - 1 - back]
    if bias is not None:
        output = output + bias
    return activate(output, activation).to(dtype)


def looped_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                layout: PackedLayout, tail: Tensor | None = None) -> Tensor:
    """One call per sequence of the convolution transformers' module has bound now (its torch
    function on CPU), as a separate forward runs it: the same arithmetic, and on CPU cheaper
    than the masked form's extra passes over the row. With a `tail`, each sequence's tail rows
    go first and their outputs are dropped (a zero tail is the zero padding: the same answer)."""
    kernel = getattr(modeling_module(), short_conv.FUNCTION_NAME)
    outputs = []
    for slot, (start, end) in enumerate(layout.spans()):
        if end == start:
            continue
        rows = x[:, start:end]
        if tail is not None:
            rows = torch.cat([tail[slot:slot + 1].to(x.dtype), rows], dim=1)
        out = kernel(rows.transpose(1, 2), weight, bias, activation=activation).transpose(1, 2)
        outputs.append(out if tail is None else out[:, tail.shape[1]:])
    return torch.cat(outputs, dim=1)


def fla_conv(kernel: Callable[..., Any]) -> ShortConv:
    """fla's Triton `causal_conv1d` with `cu_seqlens` (state reset at every boundary), the
    tails as its initial state (`[N, D, K]`, the last `K-1` columns the inputs before the
    sequence; the first is never read by a `K`-tap filter)."""

    def conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             layout: PackedLayout, tail: Tensor | None = None) -> Tensor:
        rows = x.to(weight.dtype)
        initial = None
        if tail is not None:
            initial = torch.cat([tail.new_zeros(tail.shape[0], 1, tail.shape[2]), tail],
                                dim=1).transpose(1, 2).to(rows.dtype).contiguous()
        extra = {} if initial is None else {"initial_state": initial}
        result = kernel(x=rows, weight=weight, bias=bias, activation=activation,
                        backend="triton", cu_seqlens=layout.cu_seqlens, **extra,
                        **fla_index_kwargs(kernel, layout))
        output = result[0] if isinstance(result, tuple) else result
        return output.to(x.dtype)

    return conv


# -------------------------------------------------------------------------------------------
# Full attention


def looped_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                     layout: PackedLayout, keys: KeySpans) -> Tensor:
    """One call per sequence over its keys: without cached ones, the attention function
    transformers is configured with (no mask: causal), as a separate forward of that sequence
    runs it; with them, causal aligned at the end (`attend`)."""
    outputs = []
    key_spans = zip(keys.host, keys.host[1:], strict=False)
    for (start, end), (first, last) in zip(layout.spans(), key_spans, strict=True):
        if end == start:
            continue
        outputs.append(attend(module, query[:, :, start:end],
                              key[first:last].transpose(0, 1).unsqueeze(0),
                              value[first:last].transpose(0, 1).unsqueeze(0)))
    return torch.cat(outputs, dim=1)


def attend(module: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Causal attention of `n` new queries over `key`/`value` whose last `n` rows are the new
    tokens (the rest cached): `[1, Hq, n, d]`, `[1, Hkv, S, d]` -> `[1, n, Hq, d]`. Without a
    cached part it is the attention function transformers is configured with, as a separate
    forward runs it."""
    new, total = query.shape[2], key.shape[2]
    if new == total:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, modeling_module().eager_attention_forward)
        output, _ = interface(module, query, key, value, None, dropout=0.0,
                              scaling=module.scaling)
        return output
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    past = total - new
    visible = (torch.arange(total, device=query.device).unsqueeze(0)
               <= past + torch.arange(new, device=query.device).unsqueeze(1))
    output = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype),
                                            attn_mask=visible, scale=module.scaling)
    return output.transpose(1, 2)


def varlen_attention(kernel: Callable[..., Any]) -> Attention:
    """`torch.nn.attention.varlen.varlen_attn`: packed `[T, heads, d]`, causal per sequence.

    Its keywords changed across torch releases (2.10: `is_causal`, no `scale` nor `enable_gqa`;
    later: `window_size`, `scale`, `enable_gqa`); what this torch's signature has is read once
    here. Without `enable_gqa` the key/value heads are repeated to the query heads (each serves
    consecutive query heads, as transformers' `repeat_kv`); without `scale` the kernel's default
    1/sqrt(d) is Qwen3.5's scaling.
    """
    causal = ({"window_size": CAUSAL_WINDOW} if accepts(kernel, "window_size")
              else {"is_causal": True})
    has_gqa = accepts(kernel, "enable_gqa")
    has_scale = accepts(kernel, "scale")

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                  layout: PackedLayout, keys: KeySpans) -> Tensor:
        q = query[0].transpose(0, 1).contiguous()
        k, v = key.contiguous(), value.contiguous()
        groups = q.shape[1] // k.shape[1]
        extra: dict[str, Any] = dict(causal)
        if groups > 1 and has_gqa:
            extra["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if has_scale:
            extra["scale"] = module.scaling
        elif module.scaling != q.shape[-1] ** -0.5:
            q = q * (module.scaling * q.shape[-1] ** 0.5)
        output = kernel(q, k, v, layout.cu_seqlens, keys.offsets, layout.max_seqlen,
                        keys.max_keys, **extra)
        return output.unsqueeze(0)

    return attention


# -------------------------------------------------------------------------------------------
# Choosing


LOOPED = PackedKernels(delta_rule=looped_delta_rule, conv=looped_conv, attention=looped_attention,
                       names=("per-sequence", "per-sequence", "per-sequence"), graph_safe=False)


def fla_kernels(delta_kernel: Callable[..., Any], conv_kernel: Callable[..., Any] | None,
                attention_kernel: Callable[..., Any] | None,
                fused: FusedOps = TORCH) -> PackedKernels:
    """The CUDA set: fla's varlen delta rule, fla's varlen convolution (masked torch when None),
    `varlen_attn` (per-sequence when None), and the given elementwise ops."""
    graph_safe = (accepts(delta_kernel, "chunk_indices") and attention_kernel is not None
                  and (conv_kernel is None or accepts(conv_kernel, "chunk_indices")))
    return PackedKernels(
        delta_rule=fla_delta_rule(delta_kernel),
        conv=masked_conv if conv_kernel is None else fla_conv(conv_kernel),
        attention=looped_attention if attention_kernel is None else varlen_attention(
            attention_kernel),
        names=("fla-varlen", "masked-torch" if conv_kernel is None else "fla-varlen",
               "per-sequence" if attention_kernel is None else "varlen_attn"),
        graph_safe=graph_safe,
        fused=fused,
        state_safe=graph_safe and attention_kernel is not None
        and accepts(attention_kernel, "window_size"),
    )


def load_varlen_attention(device: torch.device, dtype: torch.dtype) -> Callable[..., Any] | None:
    """`varlen_attn` where it can run (CUDA, half precision, a torch that has it), else None."""
    if device.type != "cuda" or dtype not in VARLEN_DTYPES:
        return None
    try:
        kernel = importlib.import_module(VARLEN_MODULE).varlen_attn
    except (ImportError, AttributeError) as exc:
        log.warning("torch.nn.attention.varlen is not usable (%s): packed attention runs one "
                    "sequence at a time", exc)
        return None
    # It logs "Using Flash Attention backend" at INFO on every call: 8 lines per forward.
    logging.getLogger(VARLEN_MODULE).setLevel(logging.WARNING)
    return kernel


FLA_UTILS = "fla.utils"
FLA_MEMO_SWITCH = "FLA_DISABLE_TENSOR_CACHE"


def disable_fla_memo() -> None:
    """Turn off fla's memo of index helpers (`tensor_cache`, keyed by the identity of the
    `cu_seqlens` tensor). With it, a static layout's buffer refilled in place and passed as the
    same object would get the offsets of an earlier fill, eagerly, and inside a capture the memo
    would hand back a tensor computed before recording, so replays would keep stale offsets
    whatever the buffers hold. Without it fla recomputes them (a few small device ops per layer,
    recorded in the graph). fla 0.5.0 to 0.6 read this module attribute on every call; the
    padded path passes no `cu_seqlens` and never used the memo."""
    utils = importlib.import_module(FLA_UTILS)
    if not getattr(utils, FLA_MEMO_SWITCH, False):
        setattr(utils, FLA_MEMO_SWITCH, True)
        log.info("fla's index memo is off (packed rows refill their offsets in place)")


def kernels_for(device: torch.device, dtype: torch.dtype, gdn_path: str) -> PackedKernels:
    """The packed kernels for a loaded backbone: fla's varlen kernels on the fla path, the
    per-sequence PyTorch paths otherwise (CPU, float32 on CUDA, --gdn-prefill torch). The short
    convolution follows what `--short-conv` bound at start-up (clef_worker.model.short_conv):
    fla's kernel when its adapter is installed, the masked torch convolution otherwise."""
    if gdn_path != "fla":
        return LOOPED
    delta = importlib.import_module(FLA_KERNEL_MODULE).chunk_gated_delta_rule
    disable_fla_memo()
    adapter = short_conv.installed(modeling_module())
    conv = adapter.kernel if adapter is not None else None
    kernels = fla_kernels(delta, conv, load_varlen_attention(device, dtype),
                          fused_ops_for(gdn_path))
    if not kernels.graph_safe:
        log.warning("packed kernels %s read offsets on the host: packed rows cannot be captured",
                    kernels.names)
    return kernels

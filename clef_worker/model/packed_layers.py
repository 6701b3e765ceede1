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

`PackedKernels` names the choice; `kernels_for` makes it from the loaded backbone. A kernel set
is `graph_safe` when nothing in it reads offsets on the host (the fla path with `varlen_attn`):
only then can one graph per total-token bucket replay with new offsets
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

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


class DeltaRule(Protocol):
    def __call__(self, query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                 layout: PackedLayout) -> Tensor: ...


class ShortConv(Protocol):
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                 layout: PackedLayout) -> Tensor: ...


class Attention(Protocol):
    def __call__(self, module: Any, query: Tensor, key: Tensor, value: Tensor,
                 layout: PackedLayout) -> Tensor: ...


@dataclass(frozen=True)
class PackedKernels:
    """The implementation of each sequence-mixing part of a packed forward."""

    # q, k [1, T, Hk, dk], v [1, T, Hv, dv], g, beta [1, T, Hv] -> [1, T, Hv, dv]
    delta_rule: DeltaRule
    conv: ShortConv  # x [1, T, D], weight [D, K] -> [1, T, D] (activation applied)
    attention: Attention  # q [1, Hq, T, d], k, v [1, Hkv, T, d] -> [1, T, Hq, d]
    names: tuple[str, str, str]  # (delta rule, conv, attention), for logs and `ready`
    graph_safe: bool  # no host read of offsets anywhere: one graph per bucket can replay
    # The norms, rotary, gates and MLP activation (clef_worker.model.fused): fla's fused
    # kernels on the fla path, the modules' own ops otherwise.
    fused: FusedOps = TORCH


# -------------------------------------------------------------------------------------------
# Gated delta rule


def modeling_module() -> Any:
    return importlib.import_module(MODELING_MODULE)


def looped_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                      layout: PackedLayout) -> Tensor:
    """One call per sequence of the kernel transformers' module has bound now (clef's
    small-chunk kernel on CPU), each from a zero state: the separate forward's arithmetic."""
    kernel = getattr(modeling_module(), gated_delta.KERNEL_NAME)
    outputs = []
    for start, end in layout.spans():
        if end == start:
            continue
        span = slice(start, end)
        output, _ = kernel(query[:, span], key[:, span], value[:, span], g=g[:, span],
                           beta=beta[:, span], initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=True)
        outputs.append(output)
    return torch.cat(outputs, dim=1)


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
    """fla's `chunk_gated_delta_rule` over the packed row: batch of one, `cu_seqlens`, no initial
    state (so every sequence starts from zero) and no final state."""

    def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                   layout: PackedLayout) -> Tensor:
        output, _ = kernel(query, key, value, g=g, beta=beta, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=True,
                           cu_seqlens=layout.cu_seqlens, **fla_index_kwargs(kernel, layout))
        return output

    return delta_rule


# -------------------------------------------------------------------------------------------
# Short convolution


def activate(x: Tensor, activation: str | None) -> Tensor:
    if activation is None:
        return x
    from transformers.activations import ACT2FN

    return ACT2FN[activation](x)


def masked_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                layout: PackedLayout) -> Tensor:
    """The causal depthwise convolution over the whole row, each tap masked at the boundaries:
    out[t] = sum_j w[K-1-j] x[t-j] over the j <= position[t] (the taps inside t's sequence)."""
    dtype = x.dtype
    rows = x.to(weight.dtype)
    width = weight.shape[-1]
    length = rows.shape[1]
    output = rows * weight[:, width - 1]
    for back in range(1, width):
        shifted = F.pad(rows, (0, 0, back, 0))[:, :length]  # x[t - back]
        live = (layout.positions >= back).unsqueeze(-1)  # [T, 1]
        output = output + torch.where(live, shifted, 0.0) * weight[:, width - 1 - back]
    if bias is not None:
        output = output + bias
    return activate(output, activation).to(dtype)


def looped_conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
                layout: PackedLayout) -> Tensor:
    """One call per sequence of the convolution transformers' module has bound now (its torch
    function on CPU), as a separate forward runs it: the same arithmetic, and on CPU cheaper
    than the masked form's extra passes over the row."""
    kernel = getattr(modeling_module(), short_conv.FUNCTION_NAME)
    outputs = []
    for start, end in layout.spans():
        if end > start:
            rows = x[:, start:end].transpose(1, 2)  # transformers passes [B, D, T]
            outputs.append(kernel(rows, weight, bias, activation=activation).transpose(1, 2))
    return torch.cat(outputs, dim=1)


def fla_conv(kernel: Callable[..., Any]) -> ShortConv:
    """fla's Triton `causal_conv1d` with `cu_seqlens` (state reset at every boundary)."""

    def conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             layout: PackedLayout) -> Tensor:
        result = kernel(x=x.to(weight.dtype), weight=weight, bias=bias, activation=activation,
                        backend="triton", cu_seqlens=layout.cu_seqlens,
                        **fla_index_kwargs(kernel, layout))
        output = result[0] if isinstance(result, tuple) else result
        return output.to(x.dtype)

    return conv


# -------------------------------------------------------------------------------------------
# Full attention


def looped_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                     layout: PackedLayout) -> Tensor:
    """One call per sequence of the attention function transformers is configured with (no
    mask: causal), as a separate forward of that sequence runs it."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = modeling_module()
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    outputs = []
    for start, end in layout.spans():
        if end == start:
            continue
        span = slice(start, end)
        output, _ = interface(module, query[:, :, span], key[:, :, span], value[:, :, span],
                              None, dropout=0.0, scaling=module.scaling)
        outputs.append(output)
    return torch.cat(outputs, dim=1)


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
                  layout: PackedLayout) -> Tensor:
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
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
        output = kernel(q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen,
                        layout.max_seqlen, **extra)
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


# -------------------------------------------------------------------------------------------
# The layers


def gated_delta_net(mixer: Any, x: Tensor, layout: PackedLayout, kernels: PackedKernels) -> Tensor:
    """transformers' `Qwen3_5GatedDeltaNet.forward` (no cache) over a packed row."""
    rows, length, _ = x.shape
    mixed = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(rows, length, -1, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)
    mixed = kernels.conv(mixed, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                         mixer.activation, layout)
    query, key, value, g, beta = delta_rule_inputs(mixer, mixed, a, b, rows, length,
                                                   kernels.fused)
    core = kernels.delta_rule(query, key, value, g, beta, layout)
    core = kernels.fused.gated_norm(mixer.norm, core.reshape(-1, mixer.head_v_dim),
                                    z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(rows, length, -1))


def full_attention(module: Any, x: Tensor, rotary: tuple[Tensor, Tensor], layout: PackedLayout,
                   kernels: PackedKernels) -> Tensor:
    """transformers' `Qwen3_5Attention.forward` (no cache) over a packed row."""
    query, key, value, gate = attention_inputs(module, x, rotary, kernels.fused)
    return attention_output(module, kernels.attention(module, query, key, value, layout), gate,
                            kernels.fused)


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


def packed_forward(model: Any, input_ids: Tensor, layout: PackedLayout,
                   kernels: PackedKernels) -> Tensor:
    """Last hidden state (after the final norm) of a packed row: [T] ids -> [T, hidden]."""
    if input_ids.dim() != 1 or input_ids.shape[0] != layout.total_tokens:
        raise ValueError(f"packed input_ids must be [{layout.total_tokens}] (the layout's "
                         f"tokens), got {list(input_ids.shape)}")
    fused = kernels.fused
    hidden = model.embed_tokens(input_ids).unsqueeze(0)
    rotary = fused.rotary_table(model.rotary_emb, hidden, layout.positions)
    # Each residual add is done by the norm that follows it (`fused.norm(module, update,
    # residual)` returns the normed sum and the sum): one kernel on the fla path.
    update: Tensor | None = None
    for layer in model.layers[: model.config.num_hidden_layers]:
        mixed, hidden = add_norm(fused, layer.input_layernorm, hidden, update)
        if layer.block_type == "linear_attention":
            update = gated_delta_net(layer.linear_attn, mixed, layout, kernels)
        else:
            update = full_attention(layer.self_attn, mixed, rotary, layout, kernels)
        mixed, hidden = fused.norm(layer.post_attention_layernorm, update, hidden)
        update = fused.mlp(layer.mlp, mixed)
    normed, _ = add_norm(fused, model.norm, hidden, update)
    return normed[0]


def add_norm(fused: FusedOps, module: Any, hidden: Tensor,
             update: Tensor | None) -> tuple[Tensor, Tensor]:
    """`(module(hidden + update), hidden + update)`; before the first layer there is no
    update yet."""
    if update is None:
        return fused.norm(module, hidden, None)
    return fused.norm(module, update, hidden)

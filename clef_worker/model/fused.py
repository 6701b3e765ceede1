"""The elementwise stretches of the packed forward, each as one fused kernel on the fla path.

Why: on the H200 a captured packed forward costs about 9.5 ms whatever its length, and that
fixed part is launches: about 2,000 small kernels per forward, most of them the elementwise
tails transformers' Qwen3.5 modules spell as separate tensor ops. Each RMS norm is about eight
(cast, square, mean, add, rsqrt, multiply, `1 + weight`, multiply, cast), four per layer with
the attention layers' per-head query and key norms; the Gated DeltaNet output norm and its
SiLU gate about nine; the partial rotary about a dozen; the decay `g` six; each residual add,
the MLP's SiLU-and-multiply and the attention output gate one or two more. fla-core ships
Triton kernels for each of them; this module binds them once per worker, behind one interface
whose CPU side is the modules' own arithmetic.

Two sets, chosen once per worker with the other packed kernels (`fused_ops_for`, from
`clef_worker.model.packed_layers.kernels_for`):

- `TORCH` (CPU, the torch Gated DeltaNet path, float32): exactly the loaded modules' forwards
  (`module(x)`, `residual + update`, transformers' `apply_rotary_pos_emb`), so answers there
  are bit for bit what they were (`tests/test_fused_ops.py`).
- `fla_ops()` (the fla path, bfloat16 on CUDA): fla's `rms_norm` with the residual add fused
  in (`prenorm`: the sum is written once and normed in float32), `rms_norm_gated` (norm, weight
  and SiLU gate in one pass), `rotary_embedding` over the rotary half in place (the pass-through
  half untouched), `fused_gdn_gate` for the decay, `swiglu` for the MLP and `sigmoidglu` for
  the attention output gate. They keep float32 inside each kernel where the modules round to
  bfloat16 between ops, so they differ from the reference by bfloat16 rounding only; the
  self-check bound covers that, and `tests/test_fused_fla_interpreter.py` runs every one
  under Triton's interpreter against the reference.

Qwen3.5's RMS norm scales by `1 + weight` (zero-centred weights); fla's scales by its weight.
`UnitWeights` keeps the float32 `1 + weight` of every norm, made on first use (the warm runs
before a capture) and remade if the parameter is replaced or written in place, so no forward
pays the two extra kernels.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from clef_worker.model.module_names import MODELING_MODULE

log = logging.getLogger(__name__)

FLA_NORM = "fla.modules.norm.layernorm"  # rms_norm
FLA_GATED_NORM = "fla.modules.norm.fused_norm_gate"  # rms_norm_gated
FLA_ROTARY = "fla.modules.rotary.ops"  # rotary_embedding
FLA_ACTIVATIONS = "fla.modules.activations.ops"  # swiglu, sigmoidglu
FLA_GATE = "fla.ops.gated_delta_rule.gate"  # fused_gdn_gate
# The MLP activation fla's swiglu computes (silu(gate) * up); another one keeps the module.
SWIGLU_ACTIVATIONS = ("silu", "swish")

Rotary = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class FusedOps:
    """How the packed forward computes its elementwise parts. Tensors are `[1, T, ...]`."""

    name: str  # "torch" or "fla", for logs and the op-count bench
    # (norm module, update, residual or None) -> (norm(residual + update), residual + update);
    # without a residual, (norm(update), update).
    norm: Callable[[Any, Tensor, Tensor | None], tuple[Tensor, Tensor]]
    # (Qwen3_5RMSNormGated, x [N, d], gate [N, d]) -> [N, d]
    gated_norm: Callable[[Any, Tensor, Tensor], Tensor]
    # (the model's rotary module, hidden [1, T, H], positions [T]) -> the table `rotate` takes
    rotary_table: Callable[[Any, Tensor, Tensor], Rotary]
    # (query [1, T, Hq, d], key [1, T, Hk, d], table) -> both rotated, same layout
    rotate: Callable[[Tensor, Tensor, Rotary], tuple[Tensor, Tensor]]
    # (Gated DeltaNet mixer, a [1, T, Hv]) -> the float32 log decay g
    decay: Callable[[Any, Tensor], Tensor]
    # (MLP module, x) -> its output
    mlp: Callable[[Any, Tensor], Tensor]
    # (attention output [..., Hq * d], gate [..., Hq * d]) -> output * sigmoid(gate)
    output_gate: Callable[[Tensor, Tensor], Tensor]


# -------------------------------------------------------------------------------------------
# The reference: the modules' own arithmetic


def torch_norm(module: Any, update: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    summed = update if residual is None else residual + update
    return module(summed), summed


def torch_gated_norm(module: Any, x: Tensor, gate: Tensor) -> Tensor:
    return module(x, gate)


def torch_rotary_table(rotary: Any, hidden: Tensor, positions: Tensor) -> Rotary:
    """transformers' `(cos, sin)`, `[1, T, rotary dim]` in the hidden states' dtype."""
    cos, sin = rotary(hidden, positions.unsqueeze(0))
    return cos, sin


def torch_rotate(query: Tensor, key: Tensor, table: Rotary) -> tuple[Tensor, Tensor]:
    """transformers' `apply_rotary_pos_emb` on `[1, T, heads, d]` (heads at dim 2)."""
    cos, sin = table
    apply = importlib.import_module(MODELING_MODULE).apply_rotary_pos_emb
    rotated: tuple[Tensor, Tensor] = apply(query, key, cos, sin, unsqueeze_dim=2)
    return rotated


def torch_decay(mixer: Any, a: Tensor) -> Tensor:
    return -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)


def torch_mlp(mlp: Any, x: Tensor) -> Tensor:
    return mlp(x)


def torch_output_gate(output: Tensor, gate: Tensor) -> Tensor:
    return output.contiguous() * torch.sigmoid(gate)


TORCH = FusedOps(name="torch", norm=torch_norm, gated_norm=torch_gated_norm,
                 rotary_table=torch_rotary_table, rotate=torch_rotate, decay=torch_decay,
                 mlp=torch_mlp, output_gate=torch_output_gate)


# -------------------------------------------------------------------------------------------
# fla's kernels


class UnitWeights:
    """The float32 `1 + weight` of each zero-centred norm, made once per parameter.

    Keyed by the parameter object; a cached entry is reused only while the parameter still
    holds the same storage at the same version (an in-place write bumps it), so a weight
    swapped or edited is never normed with a stale copy."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[Tensor, int, int, Tensor]] = {}

    def get(self, weight: Tensor) -> Tensor:
        key = id(weight)
        version = weight._version
        pointer = weight.data_ptr()
        hit = self.cache.get(key)
        if hit is not None and hit[0] is weight and hit[1] == version and hit[2] == pointer:
            return hit[3]
        unit = (1.0 + weight.detach().float()).contiguous()
        self.cache[key] = (weight, version, pointer, unit)
        return unit


def fla_ops() -> FusedOps:
    """The fla set. Raises ImportError when this fla lacks one of the kernels."""
    rms_norm = importlib.import_module(FLA_NORM).rms_norm
    rms_norm_gated = importlib.import_module(FLA_GATED_NORM).rms_norm_gated
    rotary_embedding = importlib.import_module(FLA_ROTARY).rotary_embedding
    activations = importlib.import_module(FLA_ACTIVATIONS)
    swiglu, sigmoidglu = activations.swiglu, activations.sigmoidglu
    fused_gdn_gate = importlib.import_module(FLA_GATE).fused_gdn_gate
    units = UnitWeights()

    def norm(module: Any, update: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        weight = units.get(module.weight)
        if residual is None:
            return rms_norm(update, weight, None, eps=module.eps), update
        normed, summed = rms_norm(update, weight, None, residual=residual, eps=module.eps,
                                  prenorm=True)
        return normed, summed

    def gated_norm(module: Any, x: Tensor, gate: Tensor) -> Tensor:
        activation = getattr(module, "activation", "silu")
        return rms_norm_gated(x, gate, module.weight, None, activation=activation,
                              eps=module.variance_epsilon)

    def rotary_table(rotary: Any, hidden: Tensor, positions: Tensor) -> Rotary:
        """Each token's own angles, `[T, rotary dim / 2]`: transformers' table repeats its
        half (`cat(freqs, freqs)`), fla's kernel takes the half and reads row t for token t."""
        cos, sin = torch_rotary_table(rotary, hidden, positions)
        half = cos.shape[-1] // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()

    def rotate(query: Tensor, key: Tensor, table: Rotary) -> tuple[Tensor, Tensor]:
        cos, sin = table
        query = rotary_embedding(query.contiguous(), cos, sin, inplace=True)
        key = rotary_embedding(key.contiguous(), cos, sin, inplace=True)
        return query, key

    def decay(mixer: Any, a: Tensor) -> Tensor:
        return fused_gdn_gate(a, mixer.A_log, mixer.dt_bias,
                              output_dtype=torch.float32)

    def mlp(module: Any, x: Tensor) -> Tensor:
        if getattr(module.config, "hidden_act", None) not in SWIGLU_ACTIVATIONS:
            return module(x)
        return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))

    def output_gate(output: Tensor, gate: Tensor) -> Tensor:
        return sigmoidglu(gate, output)

    return FusedOps(name="fla", norm=norm, gated_norm=gated_norm, rotary_table=rotary_table,
                    rotate=rotate, decay=decay, mlp=mlp, output_gate=output_gate)


def fused_ops_for(gdn_path: str) -> FusedOps:
    """fla's kernels on the fla path (where fla is imported and Triton runs), the modules'
    arithmetic elsewhere; an fla without one of them falls back with a warning."""
    if gdn_path != "fla":
        return TORCH
    try:
        return fla_ops()
    except (ImportError, AttributeError) as exc:
        log.warning("fla's fused norm/rotary/gate kernels are not usable (%s): the packed "
                    "forward runs their torch ops (more launches per forward)", exc)
        return TORCH

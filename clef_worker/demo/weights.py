"""Random tensors for a layout: one RNG stream per tensor, stored in BF16 like the release."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

from clef_worker.demo.layout import Layout

# Head scalars, chosen so that the lexical prior and the joint score both move the logits by a
# few units on random inputs: probabilities vary between options without saturating.
_SCALARS = {
    "prior_logit_scale": math.log(8.0),
    "joint_logit_scale": math.log(8.0),
    "residual_gate": 0.5,
}


def draw(name: str, shape: tuple[int, ...], kind: str, seed: int) -> Any:
    """One tensor, from its own RNG stream keyed by (seed, name): independent of the others.

    Scales keep every activation near unit size (weights ~ N(0, 1/fan_in)), so a random model
    gives finite, varied answers rather than NaNs or one-hot probabilities.
    """
    import torch

    generator = torch.Generator().manual_seed(seed * 0x9E3779B1 + zlib.crc32(name.encode()))

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    if kind == "centred_norm":
        return normal(0.1)
    if kind == "norm_weight":
        return 1.0 + normal(0.1)
    if kind == "norm_bias":
        return normal(0.05)
    if kind == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if kind == "dt_bias":
        return 1.0 + normal(0.2)
    if kind == "token_table":
        return normal(1.0)
    if kind in ("pos_embedding", "bias"):
        return normal(0.02)
    if kind == "type_embedding":
        return normal(1.0)
    if kind.startswith("scalar_"):
        return torch.full(shape, _SCALARS[kind.removeprefix("scalar_")])
    if kind == "weight":
        fan_in = math.prod(shape[1:])
        return normal(1.0 / math.sqrt(fan_in))
    raise ValueError(f"unknown init kind {kind!r} for {name}")


def save_tensors(path: Path, layout: Layout, seed: int) -> None:
    """Draw every tensor in float32 and store it in BF16, as the release does."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        name: draw(name, shape, kind, seed).to(torch.bfloat16).contiguous()
        for name, (shape, kind) in sorted(layout.items())
    }
    save_file(tensors, str(path), metadata={"format": "pt"})

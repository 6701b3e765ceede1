"""The elementwise set of the packed forward (clef_worker.model.fused): its torch side is exactly
the loaded modules' arithmetic (so CPU answers are unchanged), and the fla side is chosen once,
on the fla path only, with a torch fallback when fla lacks a kernel. fla's kernels themselves
are measured against this torch side under Triton's interpreter
(tests/test_fused_fla_interpreter.py)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from clef_worker.model import fused
from clef_worker.model.fused import TORCH, UnitWeights, fused_ops_for
from clef_worker.model.kernel_choice import bind_gdn_path
from tests.fused_interpreter import TOKENS, build_model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # As a CPU worker binds its kernels before transformers' Qwen3.5 module is imported (fla
    # blocked), so this module leaves the process as every other CPU test expects it.
    bind_gdn_path("auto", torch.device("cpu"), torch.float32)
    return build_model(torch.float32)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def layer_of(model: Any, kind: str) -> Any:
    """A decoder layer of `kind` (transformers' layers are untyped for mypy)."""
    return next(layer for layer in model.layers if layer.block_type == kind)


def test_the_torch_norm_is_the_modules_norm_and_adds_the_residual_first(model) -> None:
    layer = layer_of(model, "full_attention")
    x, residual = randn(1, TOKENS, 64, seed=1), randn(1, TOKENS, 64, seed=2)
    normed, same = TORCH.norm(layer.input_layernorm, x, None)
    assert torch.equal(normed, layer.input_layernorm(x)) and same is x
    normed, summed = TORCH.norm(layer.post_attention_layernorm, x, residual)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, layer.post_attention_layernorm(residual + x))
    # the zero-centred weights are not all zero here: a norm ignoring them would differ
    assert not torch.equal(normed, F.rms_norm(residual + x, (64,), eps=1e-6))


def test_the_torch_rotary_equals_transformers_on_the_transposed_layout(model) -> None:
    """The packed layers rotate `[1, T, heads, d]` before transposing; transformers rotates
    `[1, heads, T, d]`: the same numbers."""
    modeling = sys.modules[type(model).__module__]
    positions = torch.tensor([t % 9 for t in range(TOKENS)])
    hidden = randn(1, TOKENS, 64, seed=3)
    query, key = randn(1, TOKENS, 4, 32, seed=4), randn(1, TOKENS, 2, 32, seed=5)
    table = TORCH.rotary_table(model.rotary_emb, hidden, positions)
    got = TORCH.rotate(query, key, table)
    cos, sin = model.rotary_emb(hidden, positions.unsqueeze(0))
    expected = modeling.apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    for rotated, reference in zip(got, expected, strict=True):
        assert torch.equal(rotated.transpose(1, 2), reference)
    assert not torch.equal(got[0], query)  # something was rotated


def test_the_torch_gates_and_mlp_are_the_modules(model) -> None:
    attention = layer_of(model, "full_attention")
    mixer = layer_of(model, "linear_attention").linear_attn
    a = randn(1, TOKENS, mixer.num_v_heads, seed=6)
    assert torch.equal(TORCH.decay(mixer, a),
                       -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias))
    core, z = randn(TOKENS, 16, seed=7), randn(TOKENS, 16, seed=8)
    assert torch.equal(TORCH.gated_norm(mixer.norm, core, z), mixer.norm(core, z))
    x = randn(1, TOKENS, 64, seed=9)
    assert torch.equal(TORCH.mlp(attention.mlp, x), attention.mlp(x))
    output, gate = randn(1, TOKENS, 128, seed=10), randn(1, TOKENS, 128, seed=11)
    assert torch.equal(TORCH.output_gate(output, gate), output * torch.sigmoid(gate))


def test_only_the_fla_path_binds_flas_kernels(model, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    assert fused_ops_for("torch") is TORCH
    monkeypatch.setitem(sys.modules, fused.FLA_NORM, None)  # an fla without the norm kernel
    with caplog.at_level(logging.WARNING, logger=fused.__name__):
        assert fused_ops_for("fla") is TORCH
    assert "not usable" in caplog.text


def test_unit_weights_are_made_once_and_remade_after_a_write() -> None:
    units = UnitWeights()
    weight = torch.nn.Parameter(torch.tensor([0.5, -0.25]), requires_grad=False)
    first = units.get(weight)
    assert first.tolist() == [1.5, 0.75] and first.dtype == torch.float32
    assert units.get(weight) is first
    with torch.no_grad():
        weight.mul_(2)  # an in-place write (a weight swapped in place)
    assert units.get(weight).tolist() == [2.0, 0.5]
    other = torch.nn.Parameter(torch.tensor([0.5, -0.25]), requires_grad=False)
    assert units.get(other) is not units.get(weight)

"""fla's fused norm, gated norm, rotary, gate and activation kernels (clef_worker.model.fused)
on CPU under Triton's interpreter, against the modules' own arithmetic. Run as its own process
(`python -m tests.fused_interpreter`, `TRITON_INTERPRET=1` in its environment) by
`tests/test_fused_fla_interpreter.py`, which asserts on the JSON it prints; the harness
(autotuning without a driver, interpreted loops) is `tests.fla_interpreter`'s.

Measured: each fused op on random inputs with random weights (zero-centred norm weights away
from zero, so `1 + weight` is exercised), in float32 and in bfloat16, and one whole packed
forward of a small Qwen3.5 stack (the per-sequence sequence mixers, only the elementwise set
swapped) against the same forward with the torch set.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from benchlib.triton_interpreter import run_harness

TOKENS = 37  # not a multiple of any block size: the kernels' masks are exercised
LENGTHS = (23, 1, 40)  # one packed row of three sequences for the whole forward
SHAPE = {
    "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "vocab_size": 300,
}


def build_model(dtype: Any) -> Any:
    """The small stack, every parameter random (norm weights included)."""
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    from benchlib.flash_model import text_config

    torch.manual_seed(0)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config(SHAPE)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            elif "A_log" in name or "dt_bias" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.to(dtype).eval().requires_grad_(False)


def max_diff(got: Any, expected: Any) -> float:
    if isinstance(got, tuple):
        return max(max_diff(a, b) for a, b in zip(got, expected, strict=True))
    return float((got.float() - expected.float()).abs().max())


def magnitude(tensors: Any) -> float:
    """The largest |value| of a tensor or of a tuple of them."""
    if isinstance(tensors, tuple):
        return max(magnitude(t) for t in tensors)
    return float(tensors.float().abs().max())


def op_cases(model: Any, dtype: Any) -> dict[str, tuple[Callable[[Any], Any], ...]]:
    """Each op as (call with an ops set), on inputs drawn once."""
    import torch

    generator = torch.Generator().manual_seed(2)

    def normal(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator).to(dtype)

    hidden = model.config.hidden_size
    layer = next(layer for layer in model.layers if layer.block_type == "full_attention")
    linear = next(layer for layer in model.layers if layer.block_type == "linear_attention")
    attention, mixer = layer.self_attn, linear.linear_attn
    x, residual = normal(1, TOKENS, hidden), normal(1, TOKENS, hidden)
    heads = normal(1, TOKENS, attention.config.num_attention_heads, attention.head_dim)
    key_heads = normal(1, TOKENS, attention.config.num_key_value_heads, attention.head_dim)
    core, z = normal(TOKENS * 4, mixer.head_v_dim), normal(TOKENS * 4, mixer.head_v_dim)
    a = normal(1, TOKENS, mixer.num_v_heads)
    width = attention.config.num_attention_heads * attention.head_dim
    output, gate = normal(1, TOKENS, width), normal(1, TOKENS, width)
    positions = torch.tensor([t % 11 for t in range(TOKENS)])  # restarting, as packed rows do

    def rotated(ops: Any) -> Any:
        table = ops.rotary_table(model.rotary_emb, x, positions)
        return ops.rotate(heads.clone(), key_heads.clone(), table)

    return {
        "norm": (lambda ops: ops.norm(layer.input_layernorm, x, None)[0],),
        "norm_residual": (lambda ops: ops.norm(layer.post_attention_layernorm, x, residual),),
        "head_norm": (lambda ops: ops.norm(attention.q_norm, heads, None)[0],),
        "gated_norm": (lambda ops: ops.gated_norm(mixer.norm, core, z),),
        "rotary": (rotated,),
        "decay": (lambda ops: ops.decay(mixer, a),),
        "mlp": (lambda ops: ops.mlp(layer.mlp, x),),
        "output_gate": (lambda ops: ops.output_gate(output, gate),),
    }


def whole_forward(model: Any, ops: Any) -> float:
    import torch

    from clef_worker.model.packed import PackedLayout
    from clef_worker.model.packed_kernels import LOOPED
    from clef_worker.model.packed_layers import packed_forward

    layout = PackedLayout.from_lengths(LENGTHS, torch.device("cpu"))
    ids = torch.randint(0, SHAPE["vocab_size"], (layout.total_tokens,),
                        generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = packed_forward(model, ids, layout, LOOPED)
        got = packed_forward(model, ids, layout, dataclasses.replace(LOOPED, fused=ops))
    return max_diff(got, expected)


def measure() -> dict[str, Any]:
    import torch

    from clef_worker.model import gated_delta, packed_kernels
    from clef_worker.model.fused import TORCH, fla_ops

    gated_delta.install(packed_kernels.modeling_module())  # the CPU worker's delta rule
    ops = fla_ops()
    results: dict[str, Any] = {"name": ops.name, "ops": {}}
    for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = build_model(dtype)
        diffs = {}
        for name, (call,) in op_cases(model, dtype).items():
            with torch.inference_mode():
                expected, got = call(TORCH), call(ops)
            finite = all(torch.isfinite(t).all() for t in (got if isinstance(got, tuple)
                                                          else (got,)))
            diffs[name] = {"max_abs_diff": max_diff(got, expected), "finite": bool(finite),
                           "scale": magnitude(expected)}
        results["ops"][label] = diffs
    results["whole_forward_float32"] = whole_forward(build_model(torch.float32), ops)
    return results


def main() -> int:
    return run_harness(measure)


if __name__ == "__main__":
    sys.exit(main())

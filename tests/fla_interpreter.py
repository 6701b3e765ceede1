"""fla's real Triton kernels on CPU under Triton's interpreter, driven through the project's
CUDA-branch calls, measured against the per-sequence torch path. Run as its own process
(`python -m tests.fla_interpreter`, with `TRITON_INTERPRET=1` in its environment) by
`tests/test_packed_fla_interpreter.py`, which asserts on the JSON it prints.

Why a process of its own: Triton reads `TRITON_INTERPRET` when fla's kernels are defined, so it
must be set before fla is first imported, and the test session may have imported fla already
(or must not have it interpreted for the other tests).

The harness that lets fla-core 0.6.0 run under the interpreter (autotuning without a driver,
loop indices as interpreter scalars) is `benchlib.triton_interpreter`'s, shared with the
operation count of bench/bench_forward_ops.py.

What is driven, all from the project: `kernels_for` on the fla path (which also turns fla's
index memo off: `disable_fla_memo`), fla's short convolution bound through the project's own
adapter (`short_conv.load_fla_kernel`, `FlaShortConv`), `PackedLayout` (unaligned, its
`chunk_indices` handed to fla) and `StaticPackedLayout` refilled in place for each later mix (the
CUDA-graph layout: aligned sequences, a dummy tail, garbage in the pad slots). The reference is
`LOOPED`, the per-sequence torch path (clef's chunked delta rule, transformers' convolution),
on the real tokens only. Shapes are tiny (one key head serving two value heads, 16-wide heads)
because the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from benchlib.triton_interpreter import (
    run_harness,
)

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_WIDTH = 1, 2, 16, 4
# Three mixes: one built unaligned, then one static row refilled in place for each of the
# other two (different counts and lengths, so a fill that did not reach the buffers, or a
# kernel that memoised the first fill's indices, answers with the wrong offsets).
MIXES = ((70, 1, 57), (5, 100), (40, 30, 64))
STATIC_TOKENS, STATIC_SEQUENCES = 256, 3


def inputs(total: int, seed: int) -> dict[str, Any]:
    """Random delta-rule and convolution inputs for a row of `total` tokens, as the packed
    Gated DeltaNet layer hands them to its kernels."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator)

    return {
        "query": normal(1, total, KEY_HEADS, HEAD_DIM),
        "key": normal(1, total, KEY_HEADS, HEAD_DIM),
        "value": normal(1, total, VALUE_HEADS, HEAD_DIM),
        "g": -torch.rand(1, total, VALUE_HEADS, generator=generator) * 0.5,
        "beta": torch.rand(1, total, VALUE_HEADS, generator=generator),
        "x": normal(1, total, (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM),
    }


def gather(values: dict[str, Any], spans: Sequence[tuple[int, int]],
           lengths: Sequence[int]) -> dict[str, Any]:
    """The real tokens of each sequence (the first `length` of each span), back to back."""
    import torch

    return {name: torch.cat([tensor[:, start:start + length]
                             for (start, _), length in zip(spans, lengths, strict=False)], 1)
            for name, tensor in values.items()}


def run(kernels: Any, values: dict[str, Any], layout: Any, weight: Any, bias: Any) -> tuple[
        Any, Any]:
    delta, _ = kernels.delta_rule(values["query"], values["key"], values["value"],
                                  values["g"], values["beta"], layout)
    conv = kernels.conv(values["x"], weight, bias, "silu", layout)
    return delta, conv


def measure() -> dict[str, Any]:
    import torch

    from clef_worker.model import gated_delta, packed_kernels, short_conv, swap
    from clef_worker.model.packed import PackedLayout, StaticPackedLayout

    cpu = torch.device("cpu")
    modeling = packed_kernels.modeling_module()
    gated_delta.install(modeling)  # the CPU worker's per-sequence delta rule
    generator = torch.Generator().manual_seed(99)
    width = (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM
    weight = torch.randn(width, CONV_WIDTH, generator=generator) * 0.5
    bias = torch.randn(width, generator=generator) * 0.1

    # The reference first, while transformers' own convolution is still the bound one.
    cases = []
    static = StaticPackedLayout(STATIC_TOKENS, STATIC_SEQUENCES, cpu)
    for index, lengths in enumerate(MIXES):
        layout = PackedLayout.from_lengths(lengths, cpu) if index == 0 else static.fill(lengths)
        values = inputs(layout.total_tokens, seed=index)
        real = gather(values, layout.spans(), lengths)
        with torch.inference_mode():
            expected = run(packed_kernels.LOOPED, real, PackedLayout.from_lengths(lengths, cpu),
                           weight, bias)
        cases.append((lengths, values, expected))
    # The dense static row (sequences back to back, spare chunk pairs on an empty slot).
    dense = StaticPackedLayout(STATIC_TOKENS, STATIC_SEQUENCES, cpu, align=1)
    dense_cases = []
    for index, lengths in enumerate(MIXES):
        layout = dense.fill(lengths)
        values = inputs(layout.total_tokens, seed=10 + index)
        real = gather(values, layout.spans(), lengths)
        with torch.inference_mode():
            expected = run(packed_kernels.LOOPED, real, PackedLayout.from_lengths(lengths, cpu),
                           weight, bias)
        dense_cases.append((lengths, values, expected))

    swap.replace(modeling, short_conv.FUNCTION_NAME,
                 lambda original: short_conv.FlaShortConv(short_conv.load_fla_kernel(),
                                                          original))
    kernels = packed_kernels.kernels_for(cpu, torch.float32, "fla")
    fla_utils = importlib.import_module(packed_kernels.FLA_UTILS)
    results: dict[str, Any] = {"names": list(kernels.names), "fused": kernels.fused.name,
                               "memo_off": getattr(fla_utils, packed_kernels.FLA_MEMO_SWITCH),
                               "interpreter": os.environ.get("TRITON_INTERPRET"), "cases": []}
    for index, (lengths, values, expected) in enumerate(cases):
        # The static row is refilled in place for each later mix, after the one before ran
        # (the reference loop above left it holding the last mix's offsets).
        layout = PackedLayout.from_lengths(lengths, cpu) if index == 0 else static.fill(lengths)
        with torch.inference_mode():
            got = run(kernels, values, layout, weight, bias)
        outputs = [gather({"out": out}, layout.spans(), lengths)["out"] for out in got]
        results["cases"].append({
            "layout": "packed" if index == 0 else "static",
            "lengths": list(lengths), "offsets": list(layout.cu_seqlens_host),
            "chunk_indices": layout.chunk_indices.tolist(),
            "delta_max_abs_diff": float((outputs[0] - expected[0]).abs().max()),
            "conv_max_abs_diff": float((outputs[1] - expected[1]).abs().max()),
            "finite": bool(all(torch.isfinite(out).all() for out in got)),
        })
    results["dense"] = []
    for lengths, values, expected in dense_cases:
        layout = dense.fill(lengths)
        with torch.inference_mode():
            got = run(kernels, values, layout, weight, bias)
        outputs = [gather({"out": out}, layout.spans(), lengths)["out"] for out in got]
        results["dense"].append({
            "lengths": list(lengths), "offsets": list(layout.cu_seqlens_host),
            "chunk_indices": layout.chunk_indices.tolist(),
            "delta_max_abs_diff": float((outputs[0] - expected[0]).abs().max()),
            "conv_max_abs_diff": float((outputs[1] - expected[1]).abs().max()),
            "finite": bool(all(torch.isfinite(out).all() for out in got)),
        })
    return results


def main() -> int:
    return run_harness(measure)


if __name__ == "__main__":
    sys.exit(main())

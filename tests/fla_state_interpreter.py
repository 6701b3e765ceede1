"""fla's kernels as the stateful packed forward calls them on CUDA (clef_worker.model.stateful:
the delta rule from per-sequence state rows with final states out, the short convolution from
per-sequence tails as fla's `[N, D, K]` initial state), on a static row with `chunk_indices`,
under Triton's interpreter, against the per-sequence torch kernels from the same states. Run as
its own process (`python -m tests.fla_state_interpreter`, `TRITON_INTERPRET=1` in its
environment) by `tests/test_state_fla_interpreter.py`, which asserts on the JSON it prints; the
harness fixes are `tests/fla_interpreter.py`'s.
"""

from __future__ import annotations

import sys
from typing import Any

from benchlib.triton_interpreter import run_harness
from tests.fla_interpreter import CONV_WIDTH, HEAD_DIM, KEY_HEADS, VALUE_HEADS, inputs

# A sequence continuing from a state that ends at a point (64 tokens: its final state is the
# one to keep), one continuing and padded, one fresh (zero rows), in a 256-token static row.
LENGTHS = (64, 100, 30)
CONTINUING = (True, True, False)
STATIC_TOKENS, STATIC_SEQUENCES = 256, 3


def measure() -> dict[str, Any]:
    import torch

    from clef_worker.model import gated_delta, packed_kernels, short_conv, swap
    from clef_worker.model.packed import StaticPackedLayout

    cpu = torch.device("cpu")
    modeling = packed_kernels.modeling_module()
    gated_delta.install(modeling)
    generator = torch.Generator().manual_seed(5)
    width = (2 * KEY_HEADS + VALUE_HEADS) * HEAD_DIM
    weight = torch.randn(width, CONV_WIDTH, generator=generator) * 0.5
    bias = torch.randn(width, generator=generator) * 0.1
    # The buckets' dense row: back to back, the dummy tail, one always-empty slot.
    layout = StaticPackedLayout(STATIC_TOKENS, STATIC_SEQUENCES, cpu, align=1).fill(LENGTHS)
    slots = layout.num_sequences
    recurrent = torch.randn(slots, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=generator) * 0.1
    tails = torch.randn(slots, CONV_WIDTH - 1, width, generator=generator)
    for slot, continuing in enumerate(CONTINUING):
        if not continuing:
            recurrent[slot].zero_()
            tails[slot].zero_()
    recurrent[len(LENGTHS):].zero_()
    tails[len(LENGTHS):].zero_()
    values = inputs(STATIC_TOKENS, seed=3)

    def run(kernels: Any) -> tuple[Any, Any, Any]:
        with torch.inference_mode():
            delta, final = kernels.delta_rule(values["query"], values["key"], values["value"],
                                              values["g"], values["beta"], layout,
                                              recurrent.clone())
            conv = kernels.conv(values["x"], weight, bias, "silu", layout, tails.clone())
        return delta, final, conv

    expected = run(packed_kernels.LOOPED)  # while transformers' own convolution is bound
    swap.replace(modeling, short_conv.FUNCTION_NAME,
                 lambda original: short_conv.FlaShortConv(short_conv.load_fla_kernel(),
                                                          original))
    kernels = packed_kernels.kernels_for(cpu, torch.float32, "fla")
    got = run(kernels)
    real = torch.cat([torch.arange(start, start + length) for (start, _), length
                      in zip(layout.spans(), LENGTHS, strict=False)])
    return {
        "names": list(kernels.names),
        "sequences": layout.num_sequences,
        "delta_max_abs_diff": float((got[0][:, real] - expected[0][:, real]).abs().max()),
        "final_max_abs_diff": float((got[1][:len(LENGTHS)] - expected[1][:len(LENGTHS)])
                                    .abs().max()),
        "conv_max_abs_diff": float((got[2][:, real] - expected[2][:, real]).abs().max()),
        # the tails matter: without them the continuing sequences' first outputs differ
        "conv_tail_effect": float((expected[2][:, :CONV_WIDTH - 1]
                                   - run_without_tail(values, weight, bias, layout, tails))
                                  .abs().max()),
    }


def run_without_tail(values: Any, weight: Any, bias: Any, layout: Any, tails: Any) -> Any:
    import torch

    from clef_worker.model import packed_kernels

    with torch.inference_mode():
        out = packed_kernels.LOOPED.conv(values["x"], weight, bias, "silu", layout)
    return out[:, :tails.shape[1]]


def main() -> int:
    return run_harness(measure)


if __name__ == "__main__":
    sys.exit(main())

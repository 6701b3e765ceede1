"""fla's delta rule from initial states, as the prefixed forward runs it on CUDA (rounds of one
varlen call per segment between capture points, `initial_state` with `cu_seqlens`), on CPU
under Triton's interpreter, measured against the torch path the CPU worker runs (clef's chunked
scan from the same initial states, its states read at the same points). Run as its own process
(`python -m tests.fla_prefix_interpreter`, `TRITON_INTERPRET=1` in its environment) by
`tests/test_prefix_fla_interpreter.py`, which asserts on the JSON it prints; the harness fixes
are `tests/fla_interpreter.py`'s (why a process of its own is said there).
"""

from __future__ import annotations

import sys
from typing import Any

from benchlib.triton_interpreter import run_harness
from tests.fla_interpreter import HEAD_DIM, KEY_HEADS, VALUE_HEADS, inputs

# Two sequences in one call: the first continues from a cached state and is cut at two points
# (the second an unaligned end), the second starts from nothing and is cut once; so the rounds
# hold both, then one.
LENGTHS = (150, 70)
POINTS = ((64, 128, 150), (64,))


def measure() -> dict[str, Any]:
    import torch

    from clef_worker.model import prefix_forward
    from clef_worker.model.module_names import FLA_KERNEL_MODULE

    total = sum(LENGTHS)
    values = inputs(total, seed=7)
    generator = torch.Generator().manual_seed(8)
    initial = [torch.randn(VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=generator) * 0.1, None]
    spans = [(0, LENGTHS[0]), (LENGTHS[0], total)]
    args = (values["query"], values["key"], values["value"], values["g"], values["beta"], spans,
            initial, POINTS)
    with torch.inference_mode():
        expected, expected_states = prefix_forward.torch_delta_rule(*args)
        fla = prefix_forward.delta_rule_for("fla")
        got, states = fla(*args)
    kernel_module = sys.modules.get(FLA_KERNEL_MODULE)
    return {
        "kernel": getattr(getattr(kernel_module, "chunk_gated_delta_rule", None), "__module__",
                          ""),
        "key_heads": KEY_HEADS,
        "output_max_abs_diff": float((got - expected).abs().max()),
        "state_counts": [len(found) for found in states],
        "state_max_abs_diff": max(float((a - b).abs().max()) for found, want in
                                  zip(states, expected_states, strict=True)
                                  for a, b in zip(found, want, strict=True)),
        "state_scale": max(float(s.abs().max()) for found in expected_states for s in found),
        "finite": bool(torch.isfinite(got).all()),
    }


def main() -> int:
    return run_harness(measure)


if __name__ == "__main__":
    sys.exit(main())

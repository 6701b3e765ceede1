"""fla's fused elementwise kernels (clef_worker.model.fused) equal the modules' arithmetic: each
op under Triton's interpreter on CPU (`tests/fused_interpreter.py`, a process of its own because
`TRITON_INTERPRET=1` must be set before fla is imported), in float32 and in bfloat16, and a whole
packed forward of a small stack with only the elementwise set swapped.

Bounds: float32, 1e-5 (the ops and the forward differ only in the order of float32 operations:
about 1e-6 measured); bfloat16, two bfloat16 steps at the output's largest magnitude (2^-7 of
it: the modules round to bfloat16 between ops where fla's kernels stay in float32, so an output
can land one step either side)."""

from __future__ import annotations

from typing import Any

import pytest

from benchlib.triton_interpreter import harness_result

FLOAT32_BOUND = 1e-5
BFLOAT16_STEPS = 2 ** -7
OPS = ("norm", "norm_residual", "head_norm", "gated_norm", "rotary", "decay", "mlp",
       "output_gate")


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return harness_result("tests.fused_interpreter")


def test_every_op_was_measured_with_flas_kernels(measured: dict[str, Any]) -> None:
    assert measured["name"] == "fla"
    for dtype in ("float32", "bfloat16"):
        assert sorted(measured["ops"][dtype]) == sorted(OPS)


@pytest.mark.parametrize("op", OPS)
def test_each_fused_op_equals_the_modules_in_float32(measured: dict[str, Any], op: str) -> None:
    case = measured["ops"]["float32"][op]
    assert case["finite"]
    assert case["scale"] > 1e-3  # the op produced something to compare
    assert case["max_abs_diff"] <= FLOAT32_BOUND, case


@pytest.mark.parametrize("op", OPS)
def test_each_fused_op_equals_the_modules_within_bfloat16_rounding(measured: dict[str, Any],
                                                                    op: str) -> None:
    case = measured["ops"]["bfloat16"][op]
    assert case["finite"]
    assert case["max_abs_diff"] <= case["scale"] * BFLOAT16_STEPS, case


def test_a_whole_packed_forward_with_the_fused_set_equals_the_torch_set(
        measured: dict[str, Any]) -> None:
    assert measured["whole_forward_float32"] <= FLOAT32_BOUND

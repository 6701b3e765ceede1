"""The prefix cache's fla path (CUDA's): fla's real `chunk_gated_delta_rule` from initial
states with `cu_seqlens`, in the rounds the prefixed forward runs, under Triton's interpreter,
against the torch path from the same states (tests/fla_prefix_interpreter.py runs the kernels
in a process of its own). Bound: the packed varlen kernels' (float32)."""

from __future__ import annotations

from typing import Any

import pytest

from benchlib.triton_interpreter import harness_result
from tests.fla_prefix_interpreter import POINTS

BOUND = 1e-5


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return harness_result("tests.fla_prefix_interpreter")


def test_flas_rounds_from_initial_states_equal_the_torch_scan(measured: dict[str, Any]) -> None:
    assert measured["kernel"].startswith("fla.")  # fla's kernel ran, not a stand-in
    assert measured["finite"]
    assert measured["output_max_abs_diff"] <= BOUND, measured
    # A state at every point, each the torch scan's (a state the test can get wrong: not zero).
    assert measured["state_counts"] == [len(points) for points in POINTS]
    assert measured["state_scale"] > 1e-2
    assert measured["state_max_abs_diff"] <= BOUND * 10, measured

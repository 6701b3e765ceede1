"""The stateful packed forward's fla path (CUDA's) without a GPU: fla's varlen delta rule from
per-sequence state rows (final states out) and its short convolution from per-sequence tails,
called as clef_worker.model.stateful calls them on a static row, under Triton's interpreter,
against the per-sequence torch kernels from the same states (tests/fla_state_interpreter.py
runs them in a process of its own). Bound: the packed varlen kernels' (float32)."""

from __future__ import annotations

from typing import Any

import pytest

from benchlib.triton_interpreter import harness_result

BOUND = 1e-5


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return harness_result("tests.fla_state_interpreter")


def test_fla_from_state_rows_matches_the_torch_kernels(measured: dict[str, Any]) -> None:
    assert measured["names"][:2] == ["fla-varlen", "fla-varlen"]
    # the dense row the buckets use: 3 real sequences, the dummy tail, the empty slot
    assert measured["sequences"] == 5
    assert measured["delta_max_abs_diff"] <= BOUND
    assert measured["final_max_abs_diff"] <= BOUND
    assert measured["conv_max_abs_diff"] <= BOUND


def test_the_tails_are_read(measured: dict[str, Any]) -> None:
    assert measured["conv_tail_effect"] > 1e-3

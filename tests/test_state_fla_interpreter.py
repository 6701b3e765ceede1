"""The stateful packed forward's fla path (CUDA's) without a GPU: fla's varlen delta rule from
per-sequence state rows (final states out) and its short convolution from per-sequence tails,
called as clef_worker.model.stateful calls them on a static row, under Triton's interpreter,
against the per-sequence torch kernels from the same states (tests/fla_state_interpreter.py
runs them in a process of its own). Bound: the packed varlen kernels' (float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from benchlib.paths import REPO

BOUND = 1e-5


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "tests.fla_state_interpreter"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_fla_from_state_rows_matches_the_torch_kernels(measured: dict[str, Any]) -> None:
    assert measured["names"][:2] == ["fla-varlen", "fla-varlen"]
    # the dense row the buckets use: 3 real sequences, the dummy tail, the empty slot
    assert measured["sequences"] == 5
    assert measured["delta_max_abs_diff"] <= BOUND
    assert measured["final_max_abs_diff"] <= BOUND
    assert measured["conv_max_abs_diff"] <= BOUND


def test_the_tails_are_read(measured: dict[str, Any]) -> None:
    assert measured["conv_tail_effect"] > 1e-3

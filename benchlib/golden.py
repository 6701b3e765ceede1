"""The golden cases of tests/fixtures/clef-tiny.golden.jsonl: one loader, one comparator.

Every test and benchmark (`bench/gpu_parity.py`) that checks answers against the golden file
goes through here, so the file is read one way and compared with one set of tolerances (the
rules of tests/fixtures/README.md, "What matching them means"):

- tokens, spans and option orders: exact;
- logits: within `LOGIT_TOLERANCE` (float32 on CPU reproduces the reference's float32 values
  up to summation order);
- response bodies: equal after `json.loads`, key order included, except that a probability may
  differ by one unit in its 4th decimal, and only where its unrounded value sits on a rounding
  boundary (when the unrounded values are known; over HTTP they are not, and the one-unit
  allowance is all that is left).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from benchlib.paths import GOLDEN, MEDIA_GOLDEN

__all__ = ["GOLDEN", "LOGIT_TOLERANCE", "MEDIA_GOLDEN", "PROBABILITY_TOLERANCE", "Drift",
           "answered", "assert_response_matches", "case", "load_cases", "refused"]

LOGIT_TOLERANCE = 1e-4
# One unit in the 4th decimal of a rounded probability (plus float noise).
PROBABILITY_TOLERANCE = 1e-4 + 1e-12
PROBABILITY_KEYS = ("noul", "confidence")


@cache
def load_cases(path: Path = GOLDEN) -> tuple[dict[str, Any], ...]:
    """Every case in file order; empty when the file is missing (a test then says so)."""
    if not path.is_file():
        return ()
    lines = path.read_text(encoding="utf-8").splitlines()
    return tuple(json.loads(line) for line in lines if line)


def case(name: str, path: Path = GOLDEN) -> dict[str, Any]:
    """One case by name."""
    for candidate in load_cases(path):
        if candidate["name"] == name:
            return candidate
    raise KeyError(f"golden case {name!r} not in {path}")


def answered(path: Path = GOLDEN) -> list[dict[str, Any]]:
    """The cases the model answers (they carry `response`, `input_ids`, `questions`)."""
    return [c for c in load_cases(path) if "error" not in c]


def refused(path: Path = GOLDEN) -> list[dict[str, Any]]:
    """The cases the model refuses with the reference's message (`error.message`)."""
    return [c for c in load_cases(path) if "error" in c]


@dataclass
class Drift:
    """How far one run's per-option values are from the golden ones, over any number of cases."""

    max_logit_diff: float = 0.0
    max_probability_diff: float = 0.0
    argmax_mismatches: list[str] = field(default_factory=list)

    @property
    def within_tolerance(self) -> bool:
        return self.max_logit_diff <= LOGIT_TOLERANCE and not self.argmax_mismatches

    def add(self, golden: dict[str, Any], logits: Sequence[float],
            probabilities: Sequence[float]) -> None:
        """Fold in one answered case, given its flat per-option logits and probabilities."""
        offset = 0
        for question in golden["questions"]:
            count = len(question["option_ids"])
            mine_l = logits[offset:offset + count]
            mine_p = probabilities[offset:offset + count]
            if len(mine_l) != count or len(mine_p) != count:
                raise AssertionError(f"{golden['name']}/{question['id']}: option count differs")
            self.max_logit_diff = max(self.max_logit_diff, *(
                abs(a - b) for a, b in zip(mine_l, question["logits"], strict=True)))
            self.max_probability_diff = max(self.max_probability_diff, *(
                abs(a - b) for a, b in zip(mine_p, question["probabilities"], strict=True)))
            theirs = question["probabilities"]
            if mine_p.index(max(mine_p)) != theirs.index(max(theirs)):
                self.argmax_mismatches.append(f"{golden['name']}/{question['id']}")
            offset += count
        if offset != len(logits):
            raise AssertionError(f"{golden['name']}: {len(logits)} options, golden {offset}")


def assert_response_matches(got: Any, want: Any,
                            unrounded: Sequence[float] | None = None) -> None:
    """The response comparator (see the module docstring)."""
    for path, g, w in _leaves(got, want, "$"):
        if g == w and type(g) is type(w):
            continue
        is_probability = ".probabilities." in path or path.rsplit(".", 1)[-1] in PROBABILITY_KEYS
        assert is_probability and isinstance(g, float) and isinstance(w, float), (path, g, w)
        assert abs(g - w) <= PROBABILITY_TOLERANCE, (path, g, w)
        if unrounded is not None:
            assert _near_boundary(unrounded, g), (path, g, w, "not on a rounding boundary")


def _near_boundary(values: Sequence[float], rounded: float) -> bool:
    """Whether some unrounded probability rounds to `rounded` from near a half-unit."""
    for value in values:
        scaled = value * 10_000
        if abs(scaled - math.floor(scaled) - 0.5) < 1e-2 and abs(round(value, 4) - rounded) < 1e-9:
            return True
    return False


def _leaves(got: Any, want: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key in want:
            yield from _leaves(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            yield from _leaves(g, w, f"{path}[{index}]")
    else:
        yield path, got, want

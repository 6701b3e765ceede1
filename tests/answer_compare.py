"""Comparing two response bodies the way ../shared/README.md compares with the golden file."""

from __future__ import annotations

import json
from typing import Any

PROBABILITY_TOLERANCE = 1e-4 + 1e-9  # one unit in the 4th decimal (rounding boundaries)


def assert_same_response(got: bytes, want: bytes) -> None:
    """Equal after json.loads, except probabilities one unit apart in the 4th decimal."""
    def walk(a: Any, b: Any) -> None:
        if isinstance(a, dict):
            assert isinstance(b, dict) and list(a) == list(b)
            for key in a:
                walk(a[key], b[key])
        elif isinstance(a, list):
            assert isinstance(b, list) and len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                walk(x, y)
        elif isinstance(a, float) and isinstance(b, float):
            assert abs(a - b) <= PROBABILITY_TOLERANCE
        else:
            assert a == b
    walk(json.loads(got), json.loads(want))

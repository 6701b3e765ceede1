"""Comparing two of our own response bodies (batched vs solo, padded vs unpadded).

Like `benchlib.golden.assert_response_matches`, but every float may move by one unit in the 4th
decimal, not only probabilities: a score question's `score` is computed from its probabilities
before rounding, so it sits on a rounding boundary exactly when they do (seen with hypothesis on
the wide demo snapshot: 1.9694 vs 1.9693).
"""

from __future__ import annotations

import json
from typing import Any

from benchlib.golden import PROBABILITY_TOLERANCE


def assert_same_response(got: bytes, want: bytes) -> None:
    """Equal after json.loads, except floats one unit apart in the 4th decimal."""
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

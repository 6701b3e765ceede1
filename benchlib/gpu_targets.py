"""The GPU sitting's targets: one place that says what each summary field must reach, so the
summary judges itself (`judge`) and docs/benchmarks.md cites this file for its bounds.

A target is (comparison, bound). `kernels_per_forward` is judged against half of the
2026-12-04 sitting's count read off its profile (about 2,000 kernels per graphed forward), and
the restart and cold-start bounds are the start-up work's. A field a sitting left null is
judged None (not measured), never met.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

AT_MOST = "<="
AT_LEAST = ">="
_COMPARE: dict[str, Callable[[float, float], bool]] = {AT_MOST: operator.le,
                                                       AT_LEAST: operator.ge}

TARGETS: dict[str, tuple[str, float]] = {
    "p50_ms_400tok_state": (AT_MOST, 15.0),
    "p50_ms_hit_400_on_6600": (AT_MOST, 20.0),
    "fresh_7000_vs_replay": (AT_MOST, 1.2),
    "fresh_len_max_ratio": (AT_MOST, 1.5),
    "c32_rps": (AT_LEAST, 90.0),
    "prefix_agent_loop_speedup": (AT_LEAST, 3.0),
    "prefix_fan_out_speedup": (AT_LEAST, 3.0),
    "prefix_unrelated_speedup": (AT_LEAST, 0.97),
    "prefix_agent_loop_max_abs_diff": (AT_MOST, 1e-2),
    "kernels_per_forward": (AT_MOST, 1000.0),
    "ready_s": (AT_MOST, 60.0),
    "self_check_ms": (AT_MOST, 10_000.0),
    "restart_ready_s": (AT_MOST, 10.0),
}


def judge(summary: Mapping[str, Any],
          targets: Mapping[str, tuple[str, float]] = TARGETS) -> dict[str, bool | None]:
    """Each target's verdict on `summary`: True met, False missed, None not measured."""
    verdicts: dict[str, bool | None] = {}
    for field, (comparison, bound) in targets.items():
        value = summary.get(field)
        verdicts[field] = (None if not isinstance(value, int | float) or isinstance(value, bool)
                           else _COMPARE[comparison](float(value), bound))
    return verdicts

"""Timing and percentiles for benchmarks and stress scenarios: one way to take a duration and
one definition of p50/p99, so numbers from different scripts can be put side by side."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy


def elapsed_ms(started: float) -> float:
    """Milliseconds since `started` (a `time.perf_counter()` reading)."""
    return (time.perf_counter() - started) * 1000.0


def timed_ms(call: Callable[[], Any]) -> float:
    """Wall time of one call, in ms. The call must synchronise with the device itself (the
    executor's answer ends with a device-to-host copy), or the time is only the launch."""
    started = time.perf_counter()
    call()
    return elapsed_ms(started)


def step_times_ms(step: Callable[[], Any], repeat: int) -> list[float]:
    """The wall times of `repeat` calls of `step`, in ms, after one untimed warm-up call."""
    step()
    return [timed_ms(step) for _ in range(repeat)]


def best_ms(step: Callable[[], Any], repeat: int) -> float:
    """The fastest of `repeat` timed calls: on a shared host the minimum is the least
    disturbed."""
    return min(step_times_ms(step, repeat))


def median_ms(step: Callable[[], Any], repeat: int) -> float:
    """The median of `repeat` timed calls."""
    return float(numpy.median(step_times_ms(step, repeat)))


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (0..1) by numpy's default linear interpolation; 0.0 when there
    are no values (a scenario that measured nothing reports zero rather than failing)."""
    if not values:
        return 0.0
    return float(numpy.percentile(numpy.asarray(values, dtype=float), fraction * 100.0))


def latency_summary(samples_ms: Sequence[float], digits: int = 2) -> dict[str, float]:
    """p50 / p99 / min / max and the count of a list of latencies in ms, rounded for a report."""
    if not samples_ms:
        return {"n": 0}
    return {"p50_ms": round(percentile(samples_ms, 0.5), digits),
            "p99_ms": round(percentile(samples_ms, 0.99), digits),
            "min_ms": round(min(samples_ms), digits),
            "max_ms": round(max(samples_ms), digits),
            "n": len(samples_ms)}

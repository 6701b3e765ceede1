"""The GPU profile summary's arithmetic (bench/bench_gpu_profile.py), checked without a GPU."""

from __future__ import annotations

import pytest

from bench.bench_gpu_profile import (
    GRAPH_LAUNCH_CALLS,
    KERNEL_LAUNCH_CALLS,
    Interval,
    busy_us,
    count_calls,
    idle_fraction,
)


def test_overlapping_kernels_count_once_and_are_clipped_to_the_window() -> None:
    kernels = [Interval(0, 10), Interval(5, 15), Interval(20, 30), Interval(28, 29),
               Interval(40, 60)]
    assert busy_us(kernels, Interval(0, 100)) == 15 + 10 + 20
    assert busy_us(kernels, Interval(12, 50)) == 3 + 10 + 10  # clipped at both ends
    assert busy_us(kernels, Interval(61, 70)) == 0
    assert busy_us([], Interval(0, 10)) == 0


def test_idle_fraction_over_request_windows() -> None:
    # Two requests of 100 us; the device is busy 60 us in the first, 20 us in the second, and a
    # kernel between them (outside both windows) does not count.
    windows = [Interval(0, 100), Interval(200, 300)]
    kernels = [Interval(10, 40), Interval(30, 70), Interval(120, 180), Interval(250, 270)]
    assert idle_fraction(kernels, windows) == pytest.approx(1 - 80 / 200)
    assert idle_fraction([Interval(0, 1000)], windows) == 0.0
    assert idle_fraction(kernels, []) == 0.0


def test_launch_calls_are_told_apart() -> None:
    names = ["cudaLaunchKernel", "aten::mm", "cudaGraphLaunch", "cuLaunchKernel",
             "cudaMemcpyAsync"]
    assert count_calls(names, KERNEL_LAUNCH_CALLS) == 2
    assert count_calls(names, GRAPH_LAUNCH_CALLS) == 1

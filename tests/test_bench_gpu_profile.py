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


def test_kernels_are_classed_by_name() -> None:
    from bench.bench_gpu_profile import kernel_class

    assert kernel_class("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_class("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kernel_class("flash_fwd_kernel") == "attention"
    assert kernel_class("layer_norm_gated_fwd_kernel") == "norm"
    assert kernel_class("chunk_gated_delta_rule_fwd_kernel_h_blockdim64") == "gated_delta"
    assert kernel_class("causal_conv1d_fwd_kernel") == "conv"
    assert kernel_class("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert kernel_class("mystery") == "other"


def test_the_replay_is_found_by_its_launch_and_the_idle_time_around_it_measured() -> None:
    """One request window [0, 100] us: a host-launched copy at 5-8, the graph's three kernels
    (correlation 7, the cudaGraphLaunch's) from 20 to 60 with a gap, an eager head kernel at
    70-80 and a copy back at 90-92. Idle before the replay: 20 - 3 = 17 us; after: 40 - 12 =
    28 us; a second window without a replay adds nothing to the split."""
    from bench.bench_gpu_profile import DeviceOp, device_summary, replay_split

    ops = [DeviceOp("Memcpy HtoD", 5, 8, 1), DeviceOp("gemm_a", 20, 30, 7),
           DeviceOp("rms_norm", 30, 40, 7), DeviceOp("gemm_b", 45, 60, 7),
           DeviceOp("elementwise_head", 70, 80, 2), DeviceOp("Memcpy DtoH", 90, 92, 3),
           DeviceOp("gemm_c", 210, 220, 9)]
    split = replay_split(Interval(0, 100), ops, {7})
    assert split == {"replay_us": 40, "idle_before_us": 17, "idle_after_us": 28,
                     "kernels_in_graph": 3, "kernels_outside_graph": 1}
    assert replay_split(Interval(200, 300), ops, {7}) is None
    summary = device_summary(ops, [Interval(0, 100), Interval(200, 300)], {7})
    assert summary["kernels_per_forward"] == 2.5  # 5 kernels, copies left out, 2 requests
    assert summary["device_ms_by_class"] == {"gemm": 0.018, "norm": 0.005,
                                             "elementwise": 0.005, "copy": 0.003}
    assert summary["replay"] == {"requests": 1, "replay_ms": 0.04, "idle_before_ms": 0.017,
                                 "idle_after_ms": 0.028, "kernels_in_graph": 3.0,
                                 "kernels_outside_graph": 1.0}
    assert device_summary(ops, [Interval(0, 100)], set())["replay"] is None  # eager
    # graphs launched, but the trace holds none of their kernels: no count is claimed
    untraced = device_summary(ops, [Interval(0, 100)], {42})
    assert untraced["kernels_per_forward"] is None and "no kernel" in untraced["note"]

"""The Gated DeltaNet layers' short convolution on CUDA: fla's Triton kernel, not torch's conv.

Why: every Gated DeltaNet layer runs a causal depthwise convolution (width 4) over its q/k/v
projection before the delta rule. transformers (5.x) binds that `causal_conv1d_fn` from the
separate `causal_conv1d` package only, which has no wheel on the registry, so a CUDA worker falls
back to `F.conv1d` padded by K-1 on both sides (T+K-1 outputs, sliced to T) and a separate
activation. fla-core (the `cuda` extra, already imported for the delta rule) ships the same
convolution as one Triton kernel with the activation fused. What that saves on a GPU is not
measured yet (docs/benchmarks.md).

`bind_short_conv` runs right after `clef_worker.model.kernel_choice.bind_gdn_path` and replaces the
module-level `causal_conv1d_fn` of transformers' Qwen3.5 module, which
`Qwen3_5GatedDeltaNet.forward` looks up at call time, with `FlaShortConv`, only when the device
is CUDA, the fla Gated DeltaNet path was chosen and `fla.modules.convolution` imports (through
`clef_worker.model.swap`). Anywhere else transformers' function stays (fla's Triton kernels cannot
run on CPU, and the torch Gated DeltaNet path blocks fla altogether).

Layouts: transformers passes `[B, D, T]` (a transposed view of the `[B, T, D]` projection) and a
`[D, K]` weight and wants `[B, D, T]` back; fla's `causal_conv1d` takes and returns `[B, T, D]`.
The adapter therefore transposes in and out; both are views, so the kernel reads the projection
where it lies and the caller's transpose back to `[B, T, D]` is free.

Graph capture (clef_worker.serving.gpu.graphs): fla-core 0.6.0's fixed-shape path (no `cu_seqlens`,
which the adapter never passes) reads nothing from the device on the host: the grid is `cdiv(T,
64)` from
the tensor's shape, the output is `empty_like`, the backend dispatch and `input_guard` look only at
environment variables, strides and devices. Host syncs exist only on the packed path when fla
derives the chunk indices itself (`prepare_chunk_indices` runs `repeat_interleave` on device
counts) and in Triton's autotuning on the first call per (D, K) key, which warm-up and the
capturer's warm runs pay before recording. Packed rows (clef_worker.model.packed_layers) call
the same kernel (this adapter's `kernel`) with `cu_seqlens` and the precomputed `chunk_indices`
of `clef_worker.model.packed.PackedLayout`, so fla reads nothing on the host there either.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from clef_protocol.options import SHORT_CONV_MODES
from clef_worker.errors import StartupError
from clef_worker.model import swap
from clef_worker.model.module_names import MODELING_MODULE

log = logging.getLogger(__name__)

FUNCTION_NAME = "causal_conv1d_fn"
# fla-core 0.5 defines it there; 0.6 keeps the name as an alias of fla.modules.causal_conv1d.
FLA_CONV_MODULE = "fla.modules.convolution"
FLA_PATH = "fla-triton"
TORCH_PATH = "torch"
# What fla's kernel fuses; any other activation would be silently skipped there.
FLA_ACTIVATIONS = (None, "silu", "swish")
# transformers' keyword arguments for packed sequences, which this server never sends.
PACKED_KWARGS = ("cu_seqlens", "seq_idx")


class FlaShortConv:
    """transformers' `causal_conv1d_fn(x [B, D, T], weight [D, K], bias, activation)` on fla's
    Triton `causal_conv1d`; calls this adapter does not cover go to `original`, the function
    that was bound before (transformers' torch path)."""

    def __init__(self, kernel: Callable[..., Any], original: Callable[..., Any]):
        self.kernel = kernel
        self.original = original

    def __call__(self, hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
                 activation: str | None = None, **kwargs: Any) -> Tensor:
        if activation not in FLA_ACTIVATIONS or any(
                kwargs.get(name) is not None for name in PACKED_KWARGS):
            return self.original(hidden_states, weight, bias, activation=activation, **kwargs)
        rows = hidden_states.to(weight.dtype).transpose(1, 2)  # [B, T, D]
        result = self.kernel(x=rows, weight=weight, bias=bias, activation=activation,
                             backend="triton")
        output = result[0] if isinstance(result, tuple) else result  # (y, final_state) in 0.5+
        return output.transpose(1, 2).to(hidden_states.dtype)


def installed(module: ModuleType) -> FlaShortConv | None:
    """The adapter bound in `module`, or None when transformers' own function is there."""
    current = swap.replacement(module, FUNCTION_NAME)
    return current if isinstance(current, FlaShortConv) else None


def uninstall(module: ModuleType) -> None:
    """Put back the function that was bound before the adapter (no-op when none is bound)."""
    swap.restore(module, FUNCTION_NAME)


def load_fla_kernel() -> Callable[..., Any]:
    """fla's `causal_conv1d`; raises (ImportError, Triton errors, ...) when it cannot be used."""
    kernel = getattr(importlib.import_module(FLA_CONV_MODULE), "causal_conv1d", None)
    if not callable(kernel):
        raise ImportError(f"{FLA_CONV_MODULE} has no causal_conv1d")
    return kernel


def choose(requested: str, device: torch.device, gdn_path: str) -> Callable[..., Any] | None:
    """fla's kernel when `--short-conv` and the setup allow it, else None (the torch path).

    auto: fla on CUDA with the fla Gated DeltaNet path when the kernel imports, with a warning
    when it does not. fla: refuse to start unless all of that holds. torch: never fla.
    """
    if requested not in SHORT_CONV_MODES:
        raise StartupError(f"--short-conv {requested}: expected {', '.join(SHORT_CONV_MODES)}")
    if requested == "torch":
        return None
    if device.type != "cuda" or gdn_path != "fla":
        if requested == "fla":
            raise StartupError(f"--short-conv fla needs CUDA and the fla Gated DeltaNet path "
                               f"(device {device}, gdn path {gdn_path})")
        return None
    try:
        return load_fla_kernel()
    except Exception as exc:  # an install can fail with ImportError, Triton errors, ...
        if requested == "fla":
            raise StartupError(f"--short-conv fla: cannot import {FLA_CONV_MODULE}: "
                               f"{type(exc).__name__}: {exc}") from exc
        log.warning("fla's causal_conv1d is not usable (%s: %s): the short convolution keeps "
                    "transformers' torch path", type(exc).__name__, exc)
        return None


def bind_short_conv(device: torch.device, gdn_path: str, requested: str = "auto") -> str:
    """Bind the short convolution for this process; returns `fla-triton` or `torch`.

    Idempotent: binding again replaces an earlier adapter instead of wrapping it.
    """
    kernel = choose(requested, device, gdn_path)
    module = importlib.import_module(MODELING_MODULE)
    path = TORCH_PATH
    if kernel is None:
        uninstall(module)
    else:
        fla_kernel = kernel
        swap.replace(module, FUNCTION_NAME, lambda original: FlaShortConv(fla_kernel, original))
        path = FLA_PATH
    log.info("Gated DeltaNet short convolution: %s (--short-conv %s, device %s)", path,
             requested, device)
    return path

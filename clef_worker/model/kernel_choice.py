"""Choosing the device, the dtype and the Gated DeltaNet kernel, before transformers binds one.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from clef_protocol.options import GDN_PATHS
from clef_worker.errors import StartupError
from clef_worker.model import gated_delta
from clef_worker.model.kernel_advice import quiet_on_cpu
from clef_worker.model.module_names import FLA_KERNEL_MODULE, MODELING_MODULE

log = logging.getLogger(__name__)

# Submodules blocked besides whatever fla.* is already imported, so that a transformers version
# importing a submodule directly also fails fast.
FLA_BLOCKED = ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.layers")
CPU_BLOCKED = ("causal_conv1d",)
# The weight dtypes this project runs, by the name flags and `ready` use for them.
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The optional kernel packages that importing MODELING_MODULE binds when they are importable.
KERNEL_PACKAGES = ("fla", *CPU_BLOCKED)


def resolve_device(spec: str) -> torch.device:
    """`auto` is CUDA when available, else CPU; an explicit CUDA device must exist."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(f"--device {spec}: no CUDA device is available to this process")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise StartupError(
                f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible"
            )
    elif device.type != "cpu":
        raise StartupError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")
    return device


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA (the release's precision) and float32 on CPU."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    if spec not in dtypes:
        raise StartupError(f"--dtype {spec}: expected auto, bfloat16 or float32")
    return dtypes[spec]


def block_modules(names: tuple[str, ...]) -> None:
    """Make every import of these packages (and their already-imported submodules) fail."""
    for root in names:
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            sys.modules[name] = None  # type: ignore[assignment]
        sys.modules[root] = None  # type: ignore[assignment]


def block_fla() -> None:
    """Force transformers onto the plain-torch Gated DeltaNet path."""
    block_modules(FLA_BLOCKED)


def fla_import_error() -> str | None:
    """Why `fla.ops`'s chunk_gated_delta_rule cannot be used here, or None when it imports."""
    if sys.modules.get("fla", ...) is None:
        return "fla is blocked in this process"
    try:
        module = importlib.import_module(FLA_KERNEL_MODULE)
        if not callable(getattr(module, "chunk_gated_delta_rule", None)):
            return f"{FLA_KERNEL_MODULE} has no chunk_gated_delta_rule"
    except Exception as exc:  # an install can fail with ImportError, Triton errors, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def choose_gdn_path(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Decide `fla` or `torch` for `--gdn-prefill` and enforce it before transformers binds.

    auto: fla on CUDA in bfloat16 when `fla.ops` imports, torch otherwise. fla: refuse to start
    unless all of that holds. torch and every CPU run: block fla.
    """
    if requested not in GDN_PATHS:
        raise StartupError(f"--gdn-prefill {requested}: expected auto, fla or torch")
    if device.type != "cuda":
        if requested == "fla":
            raise StartupError(
                f"--gdn-prefill fla needs a CUDA device, but this worker runs on {device}"
            )
        block_fla()
        block_modules(CPU_BLOCKED)
        return "torch"
    if requested == "torch":
        block_fla()
        return "torch"
    if dtype == torch.float32:
        if requested == "fla":
            raise StartupError("--gdn-prefill fla needs --dtype bfloat16 (fla has no float32 path)")
        log.info("float32 on CUDA: using the torch Gated DeltaNet path (fla needs bfloat16)")
        block_fla()
        return "torch"
    error = fla_import_error()
    if error is None:
        return "fla"
    if requested == "fla":
        raise StartupError(
            f"--gdn-prefill fla: cannot import {FLA_KERNEL_MODULE} ({error}); install fla-core "
            "(pip install 'clef-serve[cuda]') or use --gdn-prefill torch"
        )
    log.warning("fla is not usable (%s): using the torch Gated DeltaNet path", error)
    block_fla()
    return "torch"


def bound_gdn_path() -> str:
    """Which kernel transformers' Qwen3.5 module bound: `fla`, `torch`, or `unknown`.

    Reads the `implementation` the fallback decorator closed over (`fallback_wrapper` finds that
    decorator's function behind the module-level name); `unknown` if a transformers version wraps
    it differently.
    """
    module = importlib.import_module(MODELING_MODULE)
    if gated_delta.is_installed(module):
        return "torch"
    function = fallback_wrapper(getattr(module, gated_delta.KERNEL_NAME, None))
    if function is None:
        return "unknown"
    implementation = inspect.getclosurevars(function).nonlocals.get("implementation")
    if implementation is None:
        return "unknown"
    root = (getattr(implementation, "__module__", None) or "").split(".")[0]
    return "fla" if root == "fla" else "torch"


def fallback_wrapper(bound: object) -> Callable[..., Any] | None:
    """The function transformers' `use_kernel_func_from_hub_with_fallback` returned, behind
    whatever the module-level name holds, or None.

    Without the `kernels` package the name holds that function itself. With it (transformers 5.25
    requires it) the hub decorator turns the function into an instance of a `Func` module, whose
    `forward` calls the function it closed over as `func`; the function is one step further.
    """
    if inspect.isfunction(bound):
        return bound
    forward = getattr(type(bound), "forward", None)
    if not inspect.isfunction(forward):
        return None
    inner = inspect.getclosurevars(forward).nonlocals.get("func")
    return inner if inspect.isfunction(inner) else None


def check_bound_gdn_path(chosen: str, *, requested: str, device: torch.device,
                         imported_before: bool) -> str:
    """After transformers' Qwen3.5 module is imported: the kernel it bound, which must be the one
    `choose_gdn_path` chose (else StartupError). Shared by every executor that lets transformers
    bind (`imported_before`: the module was already imported when the choice was made)."""
    bound = bound_gdn_path()
    if bound == "unknown":
        log.warning("cannot tell which Gated DeltaNet kernel transformers bound; assuming %s",
                    chosen)
        bound = chosen
    if bound != chosen:
        why = " (it was imported before the fla guard ran)" if imported_before else ""
        raise StartupError(
            f"transformers bound the {bound} Gated DeltaNet kernel but {chosen} was chosen"
            f"{why}; start the worker in a fresh process"
        )
    reason = quiet_on_cpu(device)
    log.info("Gated DeltaNet prefill path: %s (--gdn-prefill %s, device %s)%s", bound, requested,
             device, f": {reason}" if reason else "")
    return bound


def bind_gdn_path(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Choose, import transformers' Qwen3.5 module, and check it bound what was chosen; on CPU,
    put clef's small-chunk kernel in place of transformers' torch function."""
    already = MODELING_MODULE in sys.modules
    chosen = choose_gdn_path(requested, device, dtype)
    bound = check_bound_gdn_path(chosen, requested=requested, device=device,
                                 imported_before=already)
    if bound == "torch" and device.type == "cpu":
        gated_delta.install(importlib.import_module(MODELING_MODULE))
    return bound

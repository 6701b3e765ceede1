"""A guard for what a CUDA graph records: raise on any operation that synchronises the host with
the device or has a data-dependent output shape.

Why: a capture records kernels, not Python. An operation that reads a device value on the host
(`.item()`, `bool(tensor)`, a device-to-host copy) either fails the capture or, worse, is
baked in with the value seen at capture time; one whose output size depends on the data
(`nonzero`, `masked_select`, `unique`) cannot be replayed at a fixed shape. Both also stall the
eager path. Running the forward a capture records under `NoSyncMode` (CPU is enough: the
dispatcher sees the same operations) catches them in CI, before a GPU does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations that read device values on the host or size their output by the data.
FORBIDDEN = frozenset({
    "aten._local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.nonzero_static",
    "aten.argwhere",
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.tolist",
})
# `repeat_interleave` with a tensor of repeats sizes its output by their sum.
DATA_SIZED = {"aten.repeat_interleave": "Tensor"}


class SyncError(RuntimeError):
    """An operation that would sync or resize by data ran where a graph is recorded."""


def _host_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy from a non-CPU tensor into host memory."""
    name = func.overloadpacket._qualified_op_name.replace("::", ".")
    if name in ("aten._to_copy", "aten.to"):
        source = args[0]
        device = kwargs.get("device")
        return (isinstance(source, torch.Tensor) and source.device.type != "cpu"
                and device is not None and torch.device(device).type == "cpu")
    if name == "aten.copy_":
        destination, source = args[0], args[1]
        return (isinstance(source, torch.Tensor) and source.device.type != "cpu"
                and destination.device.type == "cpu")
    return False


class NoSyncMode(TorchDispatchMode):
    """Raises `SyncError` on the operations above; counts the operations it let through."""

    def __init__(self) -> None:
        super().__init__()
        self.operations = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
        overload = func._overloadname
        if name in FORBIDDEN or DATA_SIZED.get(name) == overload.split(".")[0] \
                or _host_copy(func, args, kwargs):
            raise SyncError(f"{name}.{overload} inside a function a CUDA graph records: it "
                            "syncs with the host or sizes its output by the data")
        self.operations += 1
        return func(*args, **kwargs)


def guarded(function: Callable[..., Any], mode: NoSyncMode | None = None) -> Callable[..., Any]:
    """`function` run under a `NoSyncMode` (a fresh one per call unless given)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with mode if mode is not None else NoSyncMode():
            return function(*args, **kwargs)

    return run

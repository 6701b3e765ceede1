"""The worker's two failures that are not about one request, and when a device is broken.

Owned here, below everything else in the worker, so that model modules (snapshot, backbone,
vision...) can refuse to start or declare the device broken without importing the serving
interface (`clef_worker.serving.executor`), and so that every executor (native, release) tells a
broken device from a failed request by one rule (`device_is_broken`, `broken_device_is_fatal`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class StartupError(Exception):
    """The executor cannot start (missing file, wrong shapes, missing kernel...).

    The message is sent to the front in a `fatal` frame and shown to the operator verbatim, so it
    must name what is wrong (the file, the tensor, the flag).
    """


class ExecutorBroken(Exception):
    """The executor can answer nothing any more, e.g. a CUDA error left the context unusable.

    Raised from `answer`: the worker replies 500 to that request and exits, so the front starts
    a fresh worker instead of failing every later request while `/health` still says ready.
    """


def device_is_broken(exc: BaseException, device: torch.device) -> bool:
    """Whether an exception means the device context is unusable (sticky CUDA errors).

    Out-of-memory is not: it fails one request and the next may fit. An illegal memory access,
    a device-side assert or a lost device poison the CUDA context for the whole process, and
    every later kernel launch would fail too.
    """
    import torch

    if device.type != "cuda" or isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


@contextmanager
def broken_device_is_fatal(device: torch.device) -> Iterator[None]:
    """Around a forward on `device`: an exception that broke the device leaves as
    `ExecutorBroken` (its cause chained); any other exception leaves unchanged."""
    try:
        yield
    except ExecutorBroken:
        raise
    except Exception as exc:
        if device_is_broken(exc, device):
            raise ExecutorBroken(f"{type(exc).__name__}: {exc}") from exc
        raise

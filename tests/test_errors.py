"""clef_worker.errors: which failures break the device, and how an executor reports them."""

from __future__ import annotations

import pytest
import torch

from clef_worker.errors import ExecutorBroken, broken_device_is_fatal, device_is_broken

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(("exc", "broken"), [
    (torch.AcceleratorError(ILLEGAL_ACCESS), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("shape '[1, 4]' is invalid for input of size 3"), False),
    (ValueError("CUDA error: in a ValueError is not a CUDA error"), False),
])
def test_which_errors_break_a_cuda_device(exc: BaseException, broken: bool) -> None:
    assert device_is_broken(exc, CUDA) is broken
    assert not device_is_broken(exc, CPU)


def test_a_broken_device_leaves_as_executor_broken() -> None:
    cause = torch.AcceleratorError(ILLEGAL_ACCESS)
    with pytest.raises(ExecutorBroken) as caught, broken_device_is_fatal(CUDA):
        raise cause
    assert caught.value.__cause__ is cause
    assert str(caught.value) == f"AcceleratorError: {ILLEGAL_ACCESS}"


@pytest.mark.parametrize(("device", "exc"), [
    (CUDA, torch.OutOfMemoryError("CUDA out of memory")),
    (CUDA, ValueError("bad value")),
    (CPU, RuntimeError("CUDA error: on a CPU executor this is one failed request")),
    (CUDA, ExecutorBroken("already classified")),
])
def test_other_errors_leave_unchanged(device: torch.device, exc: BaseException) -> None:
    with pytest.raises(type(exc)) as caught, broken_device_is_fatal(device):
        raise exc
    assert caught.value is exc


def test_no_error_no_effect() -> None:
    with broken_device_is_fatal(CUDA):
        result = 1 + 1
    assert result == 2

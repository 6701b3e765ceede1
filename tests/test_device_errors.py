"""Which exceptions mean the CUDA context is unusable (the worker must be replaced)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import ExecutorBroken, device_is_broken

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "exc",
    [
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
    ],
)
def test_sticky_cuda_errors_break_the_executor(exc: BaseException) -> None:
    assert device_is_broken(exc, CUDA)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("shape '[1, 4]' is invalid for input of size 3"),
        ValueError("CUDA error: in a ValueError is not a CUDA error"),
    ],
)
def test_recoverable_errors_do_not(exc: BaseException) -> None:
    assert not device_is_broken(exc, CUDA)


def test_nothing_breaks_a_cpu_executor() -> None:
    assert not device_is_broken(RuntimeError("CUDA error: whatever"), CPU)


def test_native_answer_reports_a_broken_device(
    tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits())
    body = b'{"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}'
    assert executor.answer(body).body.startswith(b'{"model":"m"')

    def fail(staged: object) -> None:
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(executor.runner, "stage", lambda *args: object())  # host half only
    monkeypatch.setattr(executor.runner, "run_staged", fail)
    monkeypatch.setattr(executor.backbone, "device", CUDA)  # as if it ran on a GPU
    with pytest.raises(ExecutorBroken, match="illegal memory access"):
        executor.answer(body)

"""The fla guard: with an importable (fake) fla on the path and no GPU, the worker still binds
the torch Gated DeltaNet path and answers correctly.

The fake's kernels raise if called, like the real ones do on a machine without a GPU ("0 active
drivers"). Each check runs in a fresh interpreter so no sys.modules state leaks between them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import BinaryIO, cast

import pytest

from benchlib.golden import assert_response_matches, case
from clef_protocol import messages
from clef_protocol.frames import read_frame_blocking, write_frame_blocking
from tests.conftest import REPO

FAKE_KERNEL = '''
def chunk_gated_delta_rule(*args, **kwargs):
    raise RuntimeError("fake fla kernel called: 0 active drivers")


def fused_recurrent_gated_delta_rule(*args, **kwargs):
    raise RuntimeError("fake fla kernel called: 0 active drivers")
'''


@pytest.fixture
def fake_fla(tmp_path: Path) -> Path:
    """A directory holding an importable package `fla` with fla.ops.gated_delta_rule."""
    root = tmp_path / "fake-site"
    package = root / "fla" / "ops" / "gated_delta_rule"
    package.mkdir(parents=True)
    (root / "fla" / "__init__.py").write_text('__version__ = "0.6.0"\n')
    (root / "fla" / "ops" / "__init__.py").write_text("")
    (package / "__init__.py").write_text(FAKE_KERNEL)
    return root


def _env(fake: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(REPO), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    return env


def _python(fake: Path, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=_env(fake), cwd=REPO,
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_fla_refused_on_cpu_and_premise(fake_fla: Path, tiny_snapshot: Path) -> None:
    """--gdn-prefill fla on CPU is refused before anything binds; and the premise of the guard:
    without it, transformers binds whatever `fla` imports, without looking at the device."""
    result = _python(fake_fla, f"""
        import importlib.util
        assert importlib.util.find_spec("fla") is not None, "the fake fla must be importable"
        from clef_worker.model.kernel_choice import bound_gdn_path
        from clef_worker.errors import StartupError
        from clef_worker.assembly import assemble_snapshot
        try:
            assemble_snapshot({str(tiny_snapshot)!r}, device="cpu", gdn_prefill="fla")
        except StartupError as exc:
            print(exc)
        else:
            raise SystemExit("started")
        print("bound:", bound_gdn_path())
    """)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert "--gdn-prefill fla needs a CUDA device" in lines[0]
    assert lines[-1] == "bound: fla"


def test_worker_process_answers_on_torch_path(fake_fla: Path, tiny_snapshot: Path,
                                              tmp_path: Path) -> None:
    """The real worker entry point, fake fla importable: ready says torch, answers match."""
    invoice = case("invoice")
    # The log goes to a file, never an unread pipe: a chatty worker could fill a pipe and block.
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "clef_worker", "--model", str(tiny_snapshot), "--device",
             "cpu", "--gdn-prefill", "auto"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
            env=_env(fake_fla), cwd=REPO,
        )
    try:
        assert worker.stdin is not None and worker.stdout is not None
        to_worker, from_worker = cast(BinaryIO, worker.stdin), cast(BinaryIO, worker.stdout)
        ready = read_frame_blocking(from_worker)
        assert ready is not None and ready["kind"] == messages.READY, ready
        assert ready["gdn_path"] == "torch" and ready["short_conv"] == "torch"
        assert ready["device"] == "cpu" and ready["dtype"] == "float32"
        write_frame_blocking(to_worker, messages.request(7, json.dumps(invoice["request"])
                                                            .encode("utf-8")))
        reply = read_frame_blocking(from_worker)
        assert reply is not None and reply["kind"] == messages.RESPONSE, reply
        assert reply["id"] == 7
        assert_response_matches(json.loads(reply["body"]), invoice["response"])
        write_frame_blocking(to_worker, messages.shutdown())
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log_text = log_path.read_text()
    # Said once, with the reason; transformers' advice to install CUDA-only kernels is not.
    assert log_text.count("Gated DeltaNet prefill path: torch") == 1
    assert "fla and causal_conv1d are CUDA kernels" in log_text
    assert "reference PyTorch implementation because" not in log_text, log_text


def test_kernel_advice_is_dropped_on_cpu_only() -> None:
    import logging

    import torch

    from clef_worker.model.kernel_advice import ADVICE_LOGGER, DropKernelAdvice, quiet_on_cpu

    logger = logging.getLogger(ADVICE_LOGGER)
    before = list(logger.filters)
    # Start from no filter whatever earlier tests in this process loaded; restored below.
    logger.filters[:] = [f for f in before if not isinstance(f, DropKernelAdvice)]
    try:
        assert quiet_on_cpu(torch.device("cuda")) is None
        assert not any(isinstance(f, DropKernelAdvice) for f in logger.filters)
        assert quiet_on_cpu(torch.device("cpu")) is not None
        quiet_on_cpu(torch.device("cpu"))  # idempotent: one filter
        assert sum(isinstance(f, DropKernelAdvice) for f in logger.filters) == 1
        advice = logger.makeRecord(ADVICE_LOGGER, logging.WARNING, __file__, 0,
                                   "`f` is falling back to its reference PyTorch implementation "
                                   "because `fla` is not installed.", (), None)
        other = logger.makeRecord(ADVICE_LOGGER, logging.WARNING, __file__, 0, "other", (),
                                  None)
        assert not logger.filter(advice) and logger.filter(other)
    finally:
        logger.filters[:] = before

"""Start-up: the port opens only after `ready`; a worker that cannot start stops clef-serve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.frontend_helpers import LISTENING, REPO, Serve, free_port, port_is_open


def test_port_is_closed_until_the_worker_is_ready(tmp_path: Path) -> None:
    port = free_port()
    gate = tmp_path / "ready-gate"
    with Serve("--ready-gate", str(gate), port=port, wait_listening=False) as serve:
        serve.wait_for(r"started worker pid=")
        # The worker is held before `ready` until the gate opens, however slow the machine.
        assert not port_is_open(port)
        assert serve.process.poll() is None
        gate.touch()
        match = serve.wait_for(LISTENING)
        assert int(match["port"]) == port
        serve.port = port
        assert serve.health().json()["status"] == "ready"
        assert serve.stderr.index("worker ready") < serve.stderr.index("listening on")


@pytest.mark.parametrize(("switches", "reason"), [
    (("--fatal", "snapshot /nope has no config.json"),
     r"worker could not start: snapshot /nope has no config.json"),
    (("--exit-code", "7"), r"worker exited before it was ready \(exit code 7\)"),
    (("--garbage-at-start",), r"invalid frame from worker"),
])
def test_worker_start_failure_exits_non_zero_without_binding(
    switches: tuple[str, ...], reason: str
) -> None:
    port = free_port()
    with Serve(*switches, port=port, wait_listening=False) as serve:
        code = serve.wait_exit()
        assert code != 0
        serve.wait_for(reason)
        serve.wait_for(r"not listening")
        assert "listening on" not in serve.stderr
        assert not port_is_open(port)


def test_startup_timeout_kills_a_silent_worker() -> None:
    with Serve("--ready-delay", "30", front_args=("--startup-timeout", "0.5"),
               wait_listening=False) as serve:
        assert serve.wait_exit() == 1
        serve.wait_for(r"no ready frame within 0.5s")


def test_sigterm_during_startup_stops_the_worker() -> None:
    with Serve("--ready-delay", "30", wait_listening=False) as serve:
        serve.wait_for(r"started worker pid=")
        serve.terminate()
        assert serve.wait_exit() == 0
        serve.wait_for(r"stopped during worker start-up")


def test_bad_flags_are_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clef_frontend", "--body-limit", str(64 * 1024 * 1024)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    assert "does not fit a worker frame" in result.stderr


def test_demo_worker_is_announced_loudly() -> None:
    with Serve("--demo") as serve:
        serve.wait_for(r"WARNING DEMO SNAPSHOT: .*meaningless")
        assert serve.health().json()["worker"]["demo"] is True


def test_the_front_never_imports_torch() -> None:
    code = (
        "import pkgutil, importlib, sys, clef_frontend\n"
        "for m in pkgutil.iter_modules(clef_frontend.__path__):\n"
        "    if m.name != '__main__':\n"
        "        importlib.import_module('clef_frontend.' + m.name)\n"
        "heavy = sorted(n for n in ('torch', 'transformers', 'safetensors', 'numpy')"
        " if n in sys.modules)\n"
        "print(heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_missing_worker_command_exits_non_zero() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "clef_frontend", "--port", "0",
         "--worker-command", "/nonexistent/clef-worker --flag"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 1
    assert "cannot run worker command '/nonexistent/clef-worker'" in result.stderr
    assert "listening on" not in result.stderr


def test_version_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "clef_frontend", "--version"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith("clef-serve ")

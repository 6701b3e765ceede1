"""systemd notification: a unix datagram socket stands in for systemd's $NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clef_frontend.sd_notify import Notifier, making_progress, watchdog_interval
from tests.ci_policy import require
from tests.conftest import REPO
from tests.frontend_helpers import WAIT, Serve, background, clef_body, free_port, port_is_open

UNIT = REPO / "deploy" / "clef-serve.service"


class FakeSystemd:
    """Receives notification datagrams, as systemd would, one message at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.received: list[dict[str, str]] = []

    def next(self, timeout: float = WAIT) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096)
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
        self.received.append(fields)
        return fields

    def wait_for(self, key: str, timeout: float = WAIT) -> dict[str, str]:
        """The next message that carries `key` (others are kept in `received`)."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.next(max(deadline - time.monotonic(), 0.001))
            if key in fields:
                return fields

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(tmp_path / "notify.sock")
    yield fake
    fake.close()


def test_ready_only_once_the_port_accepts_and_stopping_on_sigterm(
    systemd: FakeSystemd, tmp_path: Path
) -> None:
    gate = tmp_path / "ready-gate"
    port = free_port()
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": "200000"}
    with Serve("--ready-gate", str(gate), port=port, wait_listening=False, env=env) as serve:
        # While the worker warms up: the start timeout is extended, the port is still closed.
        extended = systemd.wait_for("EXTEND_TIMEOUT_USEC")
        assert int(extended["EXTEND_TIMEOUT_USEC"]) >= 10_000_000
        assert "warming up" in extended["STATUS"]
        assert not port_is_open(port)
        gate.touch()
        ready = systemd.wait_for("READY")
        assert ready["READY"] == "1"
        assert port_is_open(port)  # accepted the moment READY=1 arrived
        assert ready["STATUS"] == f"serving on 127.0.0.1:{port}"
        # Watchdog pings (every WATCHDOG_USEC / 2) while the front is alive and the worker idle.
        systemd.wait_for("WATCHDOG")
        systemd.wait_for("WATCHDOG")
        serve.terminate()
        stopping = systemd.wait_for("STOPPING")
        assert stopping["STOPPING"] == "1"
        assert serve.wait_exit() == 0


def test_status_follows_a_worker_restart(systemd: FakeSystemd, tmp_path: Path) -> None:
    crashed, gate = tmp_path / "crashed", tmp_path / "replacement-gate"
    env = {"NOTIFY_SOCKET": str(systemd.path)}
    with Serve("--crash-once-file", str(crashed), "--replacement-ready-gate", str(gate),
               env=env) as serve:
        systemd.wait_for("READY")
        # The request the worker dies with waits for the replacement, which holds its `ready`
        # until the gate opens: the state is observable meanwhile.
        crashing = background(lambda: serve.post(clef_body(crash=True)))
        assert systemd.wait_for("STATUS")["STATUS"] == "worker restarting"
        gate.touch()
        assert systemd.wait_for("STATUS")["STATUS"] == f"serving on 127.0.0.1:{serve.port}"
        assert crashing.result().status == 200  # sent again, answered by the replacement


def test_no_notify_socket_means_no_notifications() -> None:
    notifier = Notifier(None)
    assert not notifier.enabled
    assert notifier.ready("x") is False


def test_notifier_speaks_to_an_abstract_socket() -> None:
    name = f"clef-serve-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(WAIT)
        notifier = Notifier("@" + name)
        assert notifier.extend_timeout(1.5)
        assert receiver.recv(100) == b"EXTEND_TIMEOUT_USEC=1500000\n"
        assert notifier.stopping("bye")
        assert receiver.recv(100) == b"STOPPING=1\nSTATUS=bye\n"
        notifier.close()


def test_a_vanished_socket_does_not_stop_the_server(tmp_path: Path) -> None:
    """A NOTIFY_SOCKET nobody listens on: every notification fails (reported, never raised),
    and the server still starts, serves, keeps pinging its watchdog and stops cleanly."""
    nobody = str(tmp_path / "nobody-listens")
    notifier = Notifier(nobody)
    assert notifier.watchdog() is False
    assert notifier.ready("x") is False
    env = {"NOTIFY_SOCKET": nobody, "WATCHDOG_USEC": "100000"}  # a ping every 50 ms
    with Serve(env=env) as serve:
        serve.wait_for("cannot notify the service manager")
        assert serve.health().status == 200
        assert serve.post(clef_body()).status == 200
        serve.terminate()
        assert serve.wait_exit() == 0
    assert "Traceback" not in serve.stderr


def test_watchdog_interval_and_progress() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "abc"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) is None
    own = {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(own) == 0.5
    assert making_progress(None, 300.0, now=1e9)
    assert making_progress(100.0, 300.0, now=350.0)
    assert not making_progress(100.0, 300.0, now=1000.0)


def test_the_unit_file_verifies(tmp_path: Path) -> None:
    """`systemd-analyze verify` on the shipped unit. It checks that ExecStart exists, so that one
    path is pointed at this environment's clef-serve; every other line is verified as shipped."""
    text = UNIT.read_text()
    assert "ExecStart=/srv/clef-serve/.venv/bin/clef-serve " in text
    executable = Path(sys.executable).parent / "clef-serve"
    unit = tmp_path / "clef-serve.service"
    unit.write_text(text.replace("/srv/clef-serve/.venv/bin/clef-serve", str(executable)))
    result = subprocess.run([require("systemd-analyze"), "verify", str(unit)],
                            capture_output=True, text=True, timeout=60)
    problems = [line for line in result.stderr.splitlines() if "clef-serve.service" in line]
    assert result.returncode == 0 and not problems, result.stderr

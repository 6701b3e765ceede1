"""Loopback ports for the servers that benchmarks, stress scenarios and tests start."""

from __future__ import annotations

import socket
import subprocess
import time

HOST = "127.0.0.1"


def free_port() -> int:
    """A port nobody listens on right now (bound to 0, then released)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def port_is_open(port: int) -> bool:
    """Whether something accepts connections on `port`."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_port(port: int, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait until `process` listens on `port`; RuntimeError if it exits or the time runs out.

    For servers whose log is not read; where it is, waiting for the `listening on` line
    (`benchlib.serve.Serve`) is the better signal."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before listening")
        if port_is_open(port):
            return
        time.sleep(0.05)  # a start-up poll with a deadline
    raise RuntimeError("server did not listen in time")

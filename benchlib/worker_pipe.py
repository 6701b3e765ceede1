"""A worker process spoken to over its frame channel, for the benchmarks that measure the worker
alone (no HTTP front): keep C requests in flight, and compare answers within the golden bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, BinaryIO, cast

from benchlib.paths import REPO
from clef_protocol import messages
from clef_protocol.frames import read_frame_blocking, write_frame_blocking

TOLERANCE = 1e-4 + 1e-9


class Worker:
    """A worker process spoken to over its frame channel."""

    def __init__(self, flags: list[str], threads: int | None):
        env = dict(os.environ)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "clef_worker", *flags], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.process.stdin and self.process.stdout
        self.stdin = cast(BinaryIO, self.process.stdin)
        self.stdout = cast(BinaryIO, self.process.stdout)
        ready = read_frame_blocking(self.stdout)
        if not ready or ready["kind"] != messages.READY:
            raise SystemExit(f"worker did not start: {ready}")
        self.ready = ready

    def run(self, bodies: list[bytes], in_flight: int) -> tuple[float, dict[int, dict]]:
        """Send every body keeping `in_flight` outstanding; (seconds, replies by id)."""
        replies: dict[int, dict] = {}
        sent = 0
        started = time.perf_counter()
        while sent < min(in_flight, len(bodies)):
            write_frame_blocking(self.stdin, messages.request(sent, bodies[sent]))
            sent += 1
        while len(replies) < len(bodies):
            reply = read_frame_blocking(self.stdout)
            assert reply is not None, "worker exited"
            replies[reply["id"]] = reply
            if sent < len(bodies):
                write_frame_blocking(self.stdin, messages.request(sent, bodies[sent]))
                sent += 1
        return time.perf_counter() - started, replies

    def close(self) -> None:
        write_frame_blocking(self.stdin, messages.shutdown())
        self.process.wait(timeout=60)


def same_answer(a: bytes, b: bytes) -> bool:
    def walk(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return isinstance(y, dict) and list(x) == list(y) and all(walk(x[k], y[k]) for k in x)
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(map(walk, x, y))
        if isinstance(x, float) and isinstance(y, float):
            return abs(x - y) <= TOLERANCE
        return bool(x == y)
    return walk(json.loads(a), json.loads(b))

"""`clef-serve` in a subprocess, for tests, stress scenarios and benchmarks.

Synchronisation is by events, never by sleeping: the server's stderr is read by a thread and
callers wait (with a bound) for a log line; state changes are awaited by polling `/health` with
a deadline. By default the worker is tests/fake_worker.py (it answers at once); `real_worker`
runs `python -m clef_worker`, and `--worker-command` in `front_args` any other.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchlib.http_client import WAIT, Client, Response, clef_body
from benchlib.paths import FAKE_WORKER, REPO

LISTENING = re.compile(r"listening on http://(?P<host>[^\s:]+):(?P<port>\d+)")
# When set, every stderr line of the server (and so of its workers) is also appended to this
# file as it arrives: the GPU script's logs.txt keeps the server's output even when a step is
# killed at its time limit (benchlib.gpu_steps).
SERVER_LOG_ENV = "CLEF_BENCH_SERVER_LOG"


class Serve:
    """One `python -m clef_frontend` process with the fake worker (or, with `real_worker`, the
    real `python -m clef_worker`; then pass the model flags in `front_args`)."""

    def __init__(
        self,
        *worker_switches: str,
        front_args: tuple[str, ...] = (),
        port: int = 0,
        wait_listening: bool = True,
        real_worker: bool = False,
        startup_wait: float = WAIT,
        env: dict[str, str] | None = None,
        max_batch: int | None = None,
        answer_cache: int | None = None,
    ) -> None:
        # The server's own defaults, as operators run it (requests in flight per worker as its
        # `ready` says, the answer cache on), except two flags every server here is given:
        # `--restart-backoff 0.05` (default 0.5 s: a test that kills a worker waits a twentieth
        # of the first restart delay, the crash-loop doubling unchanged) and `--shutdown-grace 5`
        # (default 10 s: a stuck worker holds a test's teardown half as long). A test about
        # another setting passes it (`max_batch=1` where requests must visibly queue behind one
        # held at the worker; `--max-batch` in `front_args` comes later and wins) with a comment
        # why. Requests that must each reach a worker are distinct (`clef_body` numbers every
        # body it makes).
        worker = shlex.join([sys.executable, str(FAKE_WORKER), *worker_switches])
        argv = [
            sys.executable, "-m", "clef_frontend", "--port", str(port),
            *(() if real_worker else ("--worker-command", worker)),
            *(() if max_batch is None else ("--max-batch", str(max_batch))),
            *(() if answer_cache is None else ("--answer-cache", str(answer_cache))),
            "--restart-backoff", "0.05", "--shutdown-grace", "5", *front_args,
        ]
        environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(
            argv, cwd=REPO, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, errors="replace",
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        self.port = 0
        if wait_listening:
            match = self.wait_for(LISTENING, timeout=startup_wait)
            self.port = int(match["port"])

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        path = os.environ.get(SERVER_LOG_ENV)
        copy = open(path, "a", encoding="utf-8", buffering=1) if path else None  # noqa: SIM115
        try:
            for line in self.process.stderr:
                if copy is not None:
                    copy.write(f"[server] {line}" if line.endswith("\n") else f"[server] {line}\n")
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        finally:
            if copy is not None:
                copy.close()
        with self._changed:
            self._changed.notify_all()

    @property
    def stderr(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: re.Pattern[str] | str, timeout: float = WAIT) -> re.Match[str]:
        """The first stderr line matching `pattern`, waiting for it if needed."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    match = regex.search(line)
                    if match:
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (not self._reader.is_alive() and seen == len(self.lines)):
                    raise AssertionError(f"no stderr line matching {regex.pattern!r}; "
                                         f"stderr so far:\n{chr(10).join(self.lines)}")
                self._changed.wait(min(left, 0.5))

    def wait_exit(self, timeout: float = WAIT) -> int:
        code = self.process.wait(timeout)
        self._reader.join(timeout)
        return code

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) so no test leaks processes."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(WAIT)
        self._reader.join(WAIT)

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP -----------------------------------------------------------------------------

    def connect(self, timeout: float = WAIT) -> Client:
        return Client(socket.create_connection(("127.0.0.1", self.port), timeout=timeout))

    def request(self, method: str, path: str, body: bytes = b"", **kwargs: Any) -> Response:
        with self.connect() as client:
            client.send(method, path, body, **kwargs)
            return client.read_response()

    def post(self, body: bytes, **kwargs: Any) -> Response:
        return self.request("POST", "/v1/systemone", body, **kwargs)

    def health(self) -> Response:
        return self.request("GET", "/health")

    def wait_health(self, predicate: Callable[[dict[str, Any]], bool],
                    timeout: float = WAIT) -> dict[str, Any]:
        """Poll /health until `predicate(document)` holds."""
        deadline = time.monotonic() + timeout
        while True:
            document = self.health().json()
            if predicate(document):
                return document
            if time.monotonic() > deadline:
                raise AssertionError(f"/health never satisfied the condition; last: {document}")
            time.sleep(0.01)  # polling interval, not a synchronisation guess

    def hold_in_flight(self, gate: Path, tag: str = "running",
                       body: bytes | None = None) -> background:
        """POST a request the fake worker holds until `gate` exists (`body`, if given, must
        say so itself); return once in flight."""
        held = body if body is not None else clef_body(tag=tag, hold_until=str(gate))
        call = background(lambda: self.post(held))
        self.wait_health(lambda h: h["in_flight"] == 1)
        return call

    def queue(self, tags: list[str]) -> list[background]:
        """POST one request per tag, each once the previous one is visibly queued, so the
        admission order is the order of `tags`."""
        calls = []
        depth: int = self.health().json()["queue_depth"]
        for tag in tags:
            calls.append(background(functools.partial(self.post, clef_body(tag=tag))))
            depth += 1
            self.wait_health(functools.partial(_queue_depth_is, depth))
        return calls



def _queue_depth_is(depth: int, health: dict[str, Any]) -> bool:
    return bool(health["queue_depth"] == depth)


class background:
    """Run `fn` in a thread now; `result(timeout)` joins it and returns (or raises) its outcome."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._outcome: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._outcome["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            self._outcome["error"] = exc

    def done(self) -> bool:
        """Whether `fn` has returned (or raised)."""
        return not self._thread.is_alive()

    def result(self, timeout: float = WAIT) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError("background call did not finish in time")
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]

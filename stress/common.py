"""What every reliability scenario shares: its command line, its report, a raw async client.

Each scenario is one command (`python -m stress.NAME [--quick]`), talks to a real `clef-serve`
on loopback (started with tests/fake_worker.py, the zero-work worker, through the test suite's
`Serve`), bounds every loop, stops by itself, and prints a summary table. Its exit status is 0
only when every check held, so `.ci/run` can run the quick mode of all of them (`run_all.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.frontend_helpers import WAIT, Serve, build_request, clef_body

__all__ = ["WAIT", "Serve", "build_request", "clef_body"]

HOST = "127.0.0.1"


@dataclass
class Report:
    """The figures of one run and the checks it made; printed as one table."""

    name: str
    quick: bool
    rows: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    server_log: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def serve(self, *worker_switches: str, front_args: tuple[str, ...] = ()) -> Iterator[Serve]:
        """A server for this run; its log is kept, to be shown if a check fails."""
        server = Serve(*worker_switches, front_args=front_args)
        try:
            yield server
        finally:
            server.close()
            self.server_log = server.lines

    def add(self, metric: str, value: object) -> None:
        self.rows.append((metric, _shown(value)))

    def check(self, ok: bool, what: str) -> None:
        """Record a check: `what` says what must hold."""
        self.rows.append((f"check: {what}", "ok" if ok else "FAILED"))
        if not ok:
            self.failures.append(what)

    @property
    def passed(self) -> bool:
        return not self.failures

    def print(self) -> None:
        self.rows.append(("wall time (s)", f"{time.monotonic() - self.started:.1f}"))
        mode = "quick" if self.quick else "full"
        width = max(len(metric) for metric, _ in self.rows)
        print(f"\n== {self.name} ({mode}): {'PASS' if self.passed else 'FAIL'}")
        for metric, value in self.rows:
            print(f"  {metric:<{width}}  {value}")
        if not self.passed and self.server_log:
            print("  the server's last log lines:")
            for line in self.server_log[-40:]:
                print(f"    {line}")


def _shown(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def main_for(name: str, scenario: Callable[[Report], None]) -> Callable[[list[str] | None], int]:
    """The `main(argv)` of a scenario: parse --quick, run it, print its table, exit status."""

    def main(argv: list[str] | None = None) -> int:
        parser = argparse.ArgumentParser(prog=f"python -m stress.{name}")
        parser.add_argument("--quick", action="store_true", help="the short CI run")
        args = parser.parse_args(argv)
        raise_fd_limit()
        report = Report(name, args.quick)
        try:
            scenario(report)
        except Exception as exc:  # a scenario that blew up is a failed scenario, with why
            report.check(False, f"ran to the end ({type(exc).__name__}: {exc})")
        report.print()
        return 0 if report.passed else 1

    return main


def raise_fd_limit() -> None:
    """Thousands of sockets on both sides: lift the soft descriptor limit to the hard one
    (the server started afterwards inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def percentile(values: list[float], fraction: float) -> float:
    """The `fraction` quantile (nearest rank); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def latency_rows(report: Report, label: str, seconds: list[float]) -> None:
    report.add(f"{label} p50 (ms)", percentile(seconds, 0.5) * 1000)
    report.add(f"{label} p99 (ms)", percentile(seconds, 0.99) * 1000)
    report.add(f"{label} max (ms)", max(seconds, default=0.0) * 1000)
    if len(seconds) > 1:
        report.add(f"{label} mean (ms)", statistics.fmean(seconds) * 1000)


def rss_kib(pid: int) -> int:
    """A process's resident memory in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# -- a raw asyncio HTTP/1.1 client -----------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One response (Content-Length framed, as clef-serve always answers)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    if status < 200:  # 100 Continue: the real answer follows
        return await read_answer(reader)
    return Answer(status, headers, body)


class Connection:
    """One keep-alive client connection; reopened after the server closes it."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def exchange(self, raw: bytes, timeout: float = WAIT) -> Answer:
        if self._streams is None:
            self._streams = await asyncio.open_connection(HOST, self._port)
        reader, writer = self._streams
        try:
            writer.write(raw)
            answer = await asyncio.wait_for(read_answer(reader), timeout)
        except BaseException:
            await self.close()
            raise
        if answer.headers.get("connection") == "close":
            await self.close()
        return answer

    async def post(self, body: bytes, timeout: float = WAIT) -> Answer:
        return await self.exchange(build_request("POST", "/v1/systemone", body), timeout)

    async def close(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams[1].close()
            with contextlib.suppress(OSError):
                await streams[1].wait_closed()

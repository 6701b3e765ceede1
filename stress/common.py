"""What every reliability scenario shares: its command line, its report, a raw async client.

Each scenario is one command (`python -m stress.NAME [--quick]`), talks to a real `clef-serve`
on loopback (started with tests/fake_worker.py, the zero-work worker, through the helper
layer's `benchlib.serve.Serve`), bounds every loop, stops by itself, and prints a summary table.
Its exit status is 0 only when every check held, so `.ci/run` can run the quick mode of all of
them (`run_all.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The client, the server process and the percentile are the helper layer's (benchlib/), shared
# with the tests and the benchmarks; scenarios take them from here with the report.
from benchlib.http_client import (
    HOST,
    WAIT,
    Connection,
    build_request,
    clef_body,
    read_answer,
)
from benchlib.serve import Serve
from benchlib.timing import percentile

__all__ = ["HOST", "WAIT", "Connection", "Serve", "build_request", "clef_body",
           "health", "percentile", "read_answer"]


async def health(port: int) -> dict[str, Any]:
    """The server's `GET /health` document, over a connection of its own (scenarios poll it
    while their clients hold theirs)."""
    probe = Connection(port)
    try:
        return json.loads((await probe.request("GET", "/health")).body)
    finally:
        await probe.close()


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
    def serve(self, *worker_switches: str, front_args: tuple[str, ...] = (),
              **options: Any) -> Iterator[Serve]:
        """A server for this run; its log is kept, to be shown if a check fails. `options`
        go to `Serve` (`real_worker`, `startup_wait`, `max_batch`, `answer_cache`)."""
        server = Serve(*worker_switches, front_args=front_args, **options)
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

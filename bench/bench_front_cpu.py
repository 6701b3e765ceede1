"""The front's CPU time per request, for two or more versions of the code side by side.

Not a test. Throughput on a shared 2-core host drifts by several per cent within minutes, more
than one change to the front is worth, so comparing runs made at different times says little.
This starts one front per version (each with its own tree's `tests/fake_worker.py`, the
zero-work worker, and the server's defaults), loads each in turn with `--connections` clients
sending distinct POST bodies (`bench_http.py --zero-work`'s, numbered by `benchlib.http_load`:
every one a cache miss that reaches the worker) for `--seconds`, for `--rounds` turns (every
other one in reverse order), and reads the front's CPU time (user + system, /proc) over each
turn: CPU microseconds per request is what the front's code costs, and being measured turn by
turn, a change of load on the host falls on every version alike. A version is a git revision
(`--rev`, checked out in a temporary worktree) or the working tree (always measured, last in
the first turn).

    python bench/bench_front_cpu.py --rev HEAD~3                # that commit against now
    python bench/bench_front_cpu.py --rev main -- --answer-cache 0
    python bench/bench_front_cpu.py --quick                    # CI smoke run: the tree alone
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.http_load import run_load
from benchlib.net import HOST, free_port
from benchlib.paths import REPO
from benchlib.provenance import command_line, cpu_line
from benchlib.zero_work import BODY, ServerProcess


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Version:
    """One version of the code, its front, and what each turn measured."""

    label: str
    tree: Path
    server: ServerProcess | None = None
    port: int = 0
    front_us: list[float] = field(default_factory=list)
    worker_us: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)

    def start(self, server_args: list[str]) -> None:
        self.port = free_port()
        worker = shlex.join([sys.executable, str(self.tree / "tests" / "fake_worker.py")])
        self.server = ServerProcess(
            [sys.executable, "-m", "clef_frontend", "--host", HOST, "--port", str(self.port),
             "--worker-command", worker, *server_args], self.port, None, 60,
            cwd=self.tree, env={**os.environ, "PYTHONPATH": str(self.tree)})

    @property
    def pid(self) -> int:
        assert self.server is not None
        return self.server.process.pid

    def worker_pids(self) -> list[int]:
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children")
        return [int(pid) for pid in children.read_text().split()]

    def turn(self, connections: int, seconds: float, use_wrk: bool) -> None:
        workers = self.worker_pids()
        front, worker = cpu_seconds(self.pid), sum(map(cpu_seconds, workers))
        load = run_load(HOST, self.port, "POST", "/v1/systemone", BODY,
                        connections=connections, seconds=seconds, use_wrk=use_wrk,
                        distinct=True)
        if load.bad_status or not load.requests:
            raise RuntimeError(f"{self.label}: {load.bad_status} failed requests")
        self.front_us.append((cpu_seconds(self.pid) - front) / load.requests * 1e6)
        self.worker_us.append(
            (sum(map(cpu_seconds, workers)) - worker) / load.requests * 1e6)
        self.rates.append(load.requests / load.seconds)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def _checkout(rev: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet",
                    str(into), rev], check=True)
    return into


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}–{max(values):.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[],
                        help="a git revision to measure beside the working tree (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="per version per turn")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--no-wrk", action="store_true", help="the asyncio load generator")
    parser.add_argument("--quick", action="store_true", help="the working tree, one short turn")
    parser.add_argument("server_args", nargs="*", help="flags for every clef-serve (after --)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rev, args.rounds, args.seconds = [], 1, 1.0
    with tempfile.TemporaryDirectory(prefix="front-cpu-") as tmp:
        versions = [Version(rev, _checkout(rev, Path(tmp) / f"rev{n}"))
                    for n, rev in enumerate(args.rev)]
        versions.append(Version("working tree", REPO))
        try:
            for version in versions:
                version.start(args.server_args)
                version.turn(args.connections, 1.0, not args.no_wrk)  # warm-up, not counted
                version.front_us.clear()
                version.worker_us.clear()
                version.rates.clear()
            for round_ in range(args.rounds):
                # Every other turn in reverse: going first or last in a turn has an effect of
                # its own (measured: several microseconds), which then falls on both alike.
                for version in versions if round_ % 2 == 0 else versions[::-1]:
                    version.turn(args.connections, args.seconds, not args.no_wrk)
        finally:
            for version in versions:
                version.stop()
            for version in versions[:-1]:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(version.tree)], check=False)
    print(f"Command: `{command_line(__file__, argv)}`; {cpu_line()}; "
          f"{args.rounds} turns of {args.seconds:g} s at C{args.connections}, distinct bodies; "
          "medians (range).\n")
    print("| version | front CPU µs / request | zero-work worker CPU µs / request | req/s |")
    print("|---|---:|---:|---:|")
    for version in versions:
        print(f"| {version.label} | {_spread(version.front_us)} | "
              f"{_spread(version.worker_us)} | {_spread(version.rates)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

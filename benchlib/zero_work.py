"""`bench_http.py --zero-work`: the front's own cost, measured beside uvicorn on the same machine.

Three servers, started together and measured in turns (ROUNDS turns, every row once per turn,
one row at a time), so that on a shared machine a change of load falls on every row alike:
- clef-serve with tests/fake_worker.py (it answers at once): `GET /health` is the front without
  the worker hop, `POST /v1/systemone` the whole front path (h11, the contract's checks, body
  parsing and validation, admission, a frame each way over the pipe, the access log line), and
  the same POST with one body repeated the path of a cache hit (everything but the worker hop);
- uvicorn with its h11 protocol serving benchlib/zero_work_app.py, when uvicorn is installed: what
  a well-kept Python HTTP server costs for a request that does nothing.

Each row is measured at 1 connection (latency) and 32 (throughput and tail), closed loop and
keep-alive. Both servers log one access line per request to a file, as they do by default.
clef-serve runs its defaults, answer cache included, so every POST body is distinct (numbered
by the load generator, `benchlib.http_load`): each one is a miss that goes through admission
and the worker, the path that ships (but in the row that repeats one body on purpose);
uvicorn gets the same bodies.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchlib.docs_writer import DOC, raw_output_line, replace_section
from benchlib.http_load import LoadResult, run_load
from benchlib.net import free_port, wait_port
from benchlib.paths import FAKE_WORKER, REPO
from benchlib.provenance import cpu_line

BEGIN, END = "<!-- bench-http:zero-work -->", "<!-- /bench-http:zero-work -->"
BODY = json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}).encode()

# The front's targets, checked and printed with every run.
TARGET_POST_OVER_HEALTH_MS = 0.2
TARGET_SHARE_OF_UVICORN = 0.6
TARGET_P99_MS = 10.0


@dataclass(frozen=True)
class Row:
    label: str
    c1: LoadResult
    c32: LoadResult


class ServerProcess:
    """A server subprocess (stderr to `log_path`, or dropped), listening on `port` once made;
    `stop` sends SIGTERM, then SIGKILL if it lingers. Also bench_front_cpu.py's, whose fronts
    run from other checkouts (`cwd`, `env`)."""

    def __init__(self, argv: list[str], port: int, log_path: Path | None, timeout: float, *,
                 cwd: Path = REPO, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb") if log_path is not None else None
        self.process = subprocess.Popen(
            argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=self._log if self._log is not None else subprocess.DEVNULL)
        wait_port(port, self.process, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()


# Each row is measured in this many turns, the rows one after the other within a turn, so a
# change of load on a shared machine falls on every row alike instead of on whichever ran then.
ROUNDS = 4


@dataclass(frozen=True)
class _Target:
    """One row to measure: a route on a running server."""

    label: str
    port: int
    method: str
    path: str
    body: bytes
    distinct: bool = True  # every body numbered (a POST then always reaches the worker)


def _load(target: _Target, connections: int, seconds: float,
          args: argparse.Namespace) -> LoadResult:
    result = run_load("127.0.0.1", target.port, target.method, target.path, target.body,
                      connections=connections, seconds=seconds, use_wrk=not args.no_wrk,
                      distinct=target.distinct and bool(target.body))
    if result.bad_status:
        raise RuntimeError(f"{target.label}: {result.bad_status} failed requests")
    return result


def _combined(results: list[LoadResult]) -> LoadResult:
    """One cell from its turns: every request over every second, the median p50 and p99."""
    return LoadResult(
        tool=results[0].tool, connections=results[0].connections,
        seconds=sum(r.seconds for r in results), requests=sum(r.requests for r in results),
        p50_ms=statistics.median(r.p50_ms for r in results),
        p99_ms=statistics.median(r.p99_ms for r in results),
        bad_status=sum(r.bad_status for r in results))


def _measure_in_turns(targets: list[_Target], args: argparse.Namespace) -> list[Row]:
    """Every target at C1 and C32, in turns of at least a second (ROUNDS of them, fewer for a
    short run), `args.seconds` per cell in all."""
    for target in targets:
        _load(target, 4, min(1.0, args.seconds), args)  # warm-up, not reported
    rounds = _rounds(args)
    turn = args.seconds / rounds
    cells: dict[tuple[str, int], list[LoadResult]] = {}
    for _ in range(rounds):
        for target in targets:
            for connections in (1, 32):
                cells.setdefault((target.label, connections), []).append(
                    _load(target, connections, turn, args))
    return [Row(t.label, _combined(cells[(t.label, 1)]), _combined(cells[(t.label, 32)]))
            for t in targets]


def _rounds(args: argparse.Namespace) -> int:
    return max(1, min(ROUNDS, int(args.seconds)))


def _clef_server(tmp: Path, name: str, *flags: str) -> tuple[ServerProcess, int]:
    port = free_port()
    worker = shlex.join([sys.executable, str(FAKE_WORKER)])
    return ServerProcess([sys.executable, "-m", "clef_frontend", "--port", str(port),
                    "--worker-command", worker, *flags], port, tmp / name, timeout=60), port


def _uvicorn_server(tmp: Path) -> tuple[ServerProcess, int, str] | None:
    if importlib.util.find_spec("uvicorn") is None:
        return None
    import uvicorn

    port = free_port()
    server = ServerProcess([sys.executable, "-m", "uvicorn", "benchlib.zero_work_app:app",
                      "--http", "h11", "--port", str(port)], port, tmp / "uvicorn.log", timeout=30)
    return server, port, uvicorn.__version__


def _rows(args: argparse.Namespace, tmp: Path) -> tuple[list[Row], list[float]]:
    """clef-serve with its defaults (`/health` and POST), clef-serve with 16 requests in flight
    to the worker (as on a CUDA worker: frames then queue on the pipe), and uvicorn, all
    started first and then measured in turns."""
    servers: list[ServerProcess] = []
    try:
        clef, port = _clef_server(tmp, "clef.log")
        servers.append(clef)
        batch, batch_port = _clef_server(tmp, "clef-batch.log", "--max-batch", "16")
        servers.append(batch)
        targets = [
            _Target("clef-serve `GET /health` (no worker hop)", port, "GET", "/health", b""),
            _Target("clef-serve `POST /v1/systemone` (zero-work worker)", port, "POST",
                    "/v1/systemone", BODY),
            _Target("clef-serve `POST`, `--max-batch 16` (up to 16 in flight to the worker)",
                    batch_port, "POST", "/v1/systemone", BODY),
            _Target("clef-serve `POST`, one body repeated (a cache hit: no worker hop)", port,
                    "POST", "/v1/systemone", BODY, distinct=False),
        ]
        uvicorn = _uvicorn_server(tmp)
        if uvicorn is not None:
            servers.append(uvicorn[0])
            targets.append(_Target(f"uvicorn {uvicorn[2]}, h11, zero-work ASGI app (POST)",
                                   uvicorn[1], "POST", "/v1/systemone", BODY))
        rows = _measure_in_turns(targets, args)
    finally:
        for server in servers:
            server.stop()
    assert clef.log_path is not None
    text = clef.log_path.read_text(errors="replace")
    worker_ms = [float(m) for m in re.findall(r"worker_ms=([\d.]+)", text)]
    return rows, worker_ms


def _cell_us(ms: float) -> str:
    return f"{ms * 1000:.0f} µs" if ms < 1 else f"{ms:.2f} ms"


def _render(rows: list[Row], worker_ms: list[float], args: argparse.Namespace,
            load: tuple[float, float]) -> str:
    tool = rows[0].c1.tool
    lines = [
        BEGIN,
        "## The front alone: zero-work worker, beside uvicorn",
        "",
        f"Command (from the repository root): `{_command()}`",
        "",
        f"Run {datetime.date.today().isoformat()}: {_machine()}; load generator {tool}, "
        f"{args.seconds:g} s per cell in {_rounds(args)} turns (rows in turn; throughput over all "
        f"turns, latencies the median of the turns'), closed loop, keep-alive, after a 1 s "
        f"warm-up. 1-minute "
        f"load average {load[0]:.2f} at the start, {load[1]:.2f} at the end: the machine has 2 "
        "cores shared with other work, and the load generator runs on the same cores as the "
        "server, so absolute numbers move from run to run; compare rows within one run. "
        "clef-serve runs its defaults, answer cache on; every POST body is distinct (numbered "
        "by the load generator), so each one is a miss that reaches the worker, and uvicorn "
        "gets the same bodies; but in the row that repeats one body, whose every POST after the "
        "first is answered from the cache.",
        "",
        "| path | C1 p50 | C32 throughput | C32 p99 |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row.label} | {_cell_us(row.c1.p50_ms)} | "
                     f"{row.c32.throughput / 1000:.1f}k req/s | {_cell_us(row.c32.p99_ms)} |")
    if worker_ms:
        worker_ms.sort()
        lines += ["", f"The fake worker reported {worker_ms[len(worker_ms) // 2]:.1f} ms per "
                      f"request (median `worker_ms` of {len(worker_ms)} access-log lines, which "
                      "round to 0.1 ms)."]
    lines += ["", "Targets:", ""] + [f"- {line}" for line in _verdicts(rows)]
    lines += ["", raw_output_line(None), END]
    return "\n".join(lines) + "\n"


def _verdicts(rows: list[Row]) -> list[str]:
    health, post = rows[0], rows[1]
    extra = post.c1.p50_ms - health.c1.p50_ms
    out = [f"POST p50 − /health p50 at C1 = {extra * 1000:.0f} µs "
           f"(target ≤ {TARGET_POST_OVER_HEALTH_MS * 1000:.0f} µs): "
           f"{'met' if extra <= TARGET_POST_OVER_HEALTH_MS else 'NOT met'}"]
    uvicorn = [row for row in rows if row.label.startswith("uvicorn")]
    if uvicorn:
        share = post.c32.throughput / uvicorn[0].c32.throughput
        out.append(f"POST C32 throughput = {share:.2f} × uvicorn (target ≥ "
                   f"{TARGET_SHARE_OF_UVICORN}): "
                   f"{'met' if share >= TARGET_SHARE_OF_UVICORN else 'NOT met'}")
        batch = rows[2].c32.throughput / uvicorn[0].c32.throughput
        out.append(f"with `--max-batch 16`: {batch:.2f} × uvicorn")
    else:
        out.append("uvicorn is not installed: no comparison (pip install uvicorn)")
    out.append(f"POST C32 p99 = {_cell_us(post.c32.p99_ms)} (target ≤ {TARGET_P99_MS:g} ms): "
               f"{'met' if post.c32.p99_ms <= TARGET_P99_MS else 'NOT met'}")
    return out


def _machine() -> str:
    return f"{cpu_line()}, Python {platform.python_version()}"


def _command() -> str:
    python = Path(sys.executable)
    shown = ".venv/bin/python" if python.is_relative_to(REPO / ".venv") else "python"
    return " ".join([shown, "bench/bench_http.py", *map(shlex.quote, sys.argv[1:])])


def run_zero_work(args: argparse.Namespace) -> int:
    """Measure and print the table; with `--write-docs`, put it in docs/benchmarks.md."""
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        rows, worker_ms = _rows(args, Path(tmp))
    section = _render(rows, worker_ms, args, (load_before, os.getloadavg()[0]))
    print(section)
    if args.write_docs:
        replace_section(section, BEGIN, END)
        print(f"wrote {DOC}", file=sys.stderr)
    return 0

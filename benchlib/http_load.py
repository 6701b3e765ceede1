"""Closed-loop HTTP load for the benchmarks: wrk when installed, clef-bench's loop otherwise.

Each connection sends one request, waits for the whole answer, and sends the next (keep-alive),
for a fixed duration; the result is the completed count, the per-request latencies' p50 and p99,
and how many answers were not the expected status. wrk (Debian package `wrk`) is preferred
because a load generator written in Python spends as much CPU per request as the server under
test, which on a small machine caps what can be measured; the asyncio loop of clef-bench
(`clef_tools.load`) is the fallback so the benchmark still runs (and CI can smoke-test it) where
wrk is absent.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchlib.timing import percentile
from clef_tools.http_client import Endpoint
from clef_tools.load import closed_loop


@dataclass(frozen=True)
class LoadResult:
    tool: str
    connections: int
    seconds: float
    requests: int
    p50_ms: float
    p99_ms: float
    bad_status: int

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds


def run_load(host: str, port: int, method: str, path: str, body: bytes, *, connections: int,
             seconds: float, expect: int = 200, use_wrk: bool = True) -> LoadResult:
    """Load one route; wrk when asked for and installed, else the asyncio client."""
    if use_wrk and shutil.which("wrk"):
        return _wrk(host, port, method, path, body, connections, seconds)
    return asyncio.run(_asyncio_load(host, port, method, path, body, connections, seconds, expect))


# -- wrk ---------------------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _duration_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if match is None:
        raise ValueError(f"unexpected wrk duration {text!r}")
    return float(match[1]) * _UNITS[match[2]]


def _wrk(host: str, port: int, method: str, path: str, body: bytes, connections: int,
         seconds: float) -> LoadResult:
    lua = (f'wrk.method = "{method}"\n'
           f'wrk.headers["Content-Type"] = "application/json"\n'
           f"wrk.body = [==[{body.decode('utf-8')}]==]\n")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "request.lua"
        script.write_text(lua, encoding="utf-8")
        threads = min(connections, 2)
        completed = subprocess.run(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
             "--latency", "-s", str(script), f"http://{host}:{port}{path}"],
            capture_output=True, text=True, check=True,
        )
    out = completed.stdout
    percent = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.MULTILINE))
    total = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m)", out, re.MULTILINE)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    socket_errors = sum(int(n) for n in re.findall(r"\d+", errors[1])) if errors else 0
    if total is None or set(percent) != {"50", "99"}:
        raise RuntimeError(f"cannot read wrk's report:\n{out}")
    return LoadResult(
        tool="wrk", connections=connections,
        seconds=_duration_ms(total[2] + total[3]) / 1000.0, requests=int(total[1]),
        p50_ms=_duration_ms(percent["50"]), p99_ms=_duration_ms(percent["99"]),
        bad_status=(int(bad[1]) if bad else 0) + socket_errors,
    )


# -- asyncio fallback --------------------------------------------------------------------------


async def _asyncio_load(host: str, port: int, method: str, path: str, body: bytes,
                        connections: int, seconds: float, expect: int) -> LoadResult:
    run = await closed_loop(Endpoint(host, port), method, path, lambda _number: body,
                            clients=connections, seconds=seconds,
                            timeout=max(60.0, seconds * 4))
    latencies = [sample.ms for sample in run.samples]
    bad = sum(sample.outcome != str(expect) for sample in run.samples)
    return LoadResult("python-asyncio", connections, run.wall_s, len(latencies),
                      percentile(latencies, 0.5), percentile(latencies, 0.99), bad)

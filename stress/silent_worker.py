"""Checks that a silent worker is suspect within a second and that what it holds is answered by
the other worker, and that a slow but live forward is never killed. Two real workers on the
tiny snapshot (CPU), the front's defaults (`--stall-timeout 30`, `--max-batch` by device, the
answer cache on), one server, in this order (3, 2, 1):

1. idle wedge: one worker is SIGSTOPped while idle, then 40 sequential requests with a 5 s client
   timeout: every one 200, the slowest within 2 s; the stopped worker is suspect in /health,
   counted, and replaced well before the stall timeout (it owed a pong with nothing ahead);
2. wedge mid-forward: a mid-size request is in a worker's forward when that worker is stopped:
   the other worker answers it long before the stall timeout; the stopped one, let go again,
   answers too, and its answer is dropped (one answer per client), and it is healthy again;
3. slow but live: 16k-token requests (seconds each on CPU) on both workers, with small ones
   around them: every answer 200 and no worker restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from benchlib.paths import TINY_SNAPSHOT
from clef_tools.http_client import HttpResponse
from stress.common import (
    Connection,
    Report,
    Serve,
    health,
    latency_rows,
    main_for,
)

REQUESTS = 40
CLIENT_TIMEOUT = 5.0
SLOWEST_ALLOWED = 2.0
STALL = 30.0  # the front's default --stall-timeout, which this scenario does not change
MID_WORDS = 1500  # a mid-size state (~13 KB): a forward of a fraction of a second on CPU
LONG_WORDS = 8000  # past 16k tokens: the state is cut to --max-length, seconds on CPU


def body(tag: str, words: int = 1) -> bytes:
    state = " ".join(f"word{i}" for i in range(words)) if words > 1 else tag
    return json.dumps({"model": "m", "state": state, "tag": tag,
                       "questions": {"q": {"type": "noul"}}}).encode()


def scenario(report: Report) -> None:
    with report.serve(real_worker=True, startup_wait=300, max_batch=None, answer_cache=None,
                      front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                                  "--workers", "2")) as serve, _resumed() as stopped:
        asyncio.run(slow_but_live(report, serve))
        asyncio.run(wedge_mid_forward(report, serve, stopped))
        asyncio.run(idle_wedge(report, serve, stopped))  # last: --quick need not wait for its
        # replacement


@contextlib.contextmanager
def _resumed() -> Iterator[set[int]]:
    """The pids this scenario stopped: each gets SIGCONT at the end, whatever happened."""
    stopped: set[int] = set()
    try:
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def idle_wedge(report: Report, serve: Serve, stopped: set[int]) -> None:
    port = serve.port
    for i in range(4):  # the server has been serving: both workers answered
        assert (await post(port, body(f"warm{i}"), 60)).status == 200
    victim = (await health(port))["workers"][0]["pid"]
    os.kill(victim, signal.SIGSTOP)
    stopped.add(victim)
    began = time.monotonic()
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    suspect_seen_at: float | None = None
    connection = Connection(port)
    try:
        for i in range(REQUESTS):
            started = time.monotonic()
            try:
                answer = await connection.post(body(f"seq{i}"), timeout=CLIENT_TIMEOUT)
                statuses[str(answer.status)] += 1
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                statuses[type(exc).__name__] += 1
                await connection.close()
                connection = Connection(port)
            latencies.append(time.monotonic() - started)
            if suspect_seen_at is None and (await health(port))["suspect_workers"]:
                suspect_seen_at = time.monotonic() - began
    finally:
        await connection.close()
    # The full run waits for the replacement to be ready; --quick only for the kill (a real
    # worker's start takes 10-20 s on a loaded 2-core box).
    replaced_after = (await _killed(serve, victim, began) if report.quick
                      else await _replaced(port, victim, began))
    stopped.discard(victim)  # killed and reaped by the front
    report.add("idle wedge: statuses", dict(statuses))
    latency_rows(report, "idle wedge: request", latencies)
    report.add("idle wedge: /health showed it suspect after (s)", suspect_seen_at)
    report.add(f"idle wedge: {'killed' if report.quick else 'replaced'} after (s)",
               replaced_after)
    report.add("workers suspected in the whole run (clef_worker_suspects_total)",
               await counter(port, "clef_worker_suspects_total"))
    report.check(statuses == Counter({"200": REQUESTS}),
                 f"idle wedge: all {REQUESTS} sequential requests answered 200")
    report.check(max(latencies) <= SLOWEST_ALLOWED,
                 f"idle wedge: the slowest took at most {SLOWEST_ALLOWED:g} s")
    report.check(suspect_seen_at is not None, "idle wedge: /health named the stopped worker")
    report.check(replaced_after is not None and replaced_after < STALL,
                 "idle wedge: killed before the stall timeout (nothing ahead of its pong)")
    report.check(bool(re.search(rf"worker pid={victim} failed .*no pong within .* with no "
                                r"request ahead of it.*reason=stalled", "\n".join(serve.lines))),
                 "idle wedge: logged as stalled, with no request ahead of its pong")


async def wedge_mid_forward(report: Report, serve: Serve, stopped: set[int]) -> None:
    port = serve.port
    for i in range(2):  # each worker learns what a mid-size forward costs
        assert (await post(port, body(f"mid-warm{i}", MID_WORDS), 60)).status == 200
    restarts = (await health(port))["restarts"]
    began = time.monotonic()
    held = asyncio.create_task(post(port, body("mid-held", MID_WORDS), 60))
    victim = None
    while victim is None and time.monotonic() - began < 10:
        busy = [w["pid"] for w in (await health(port))["workers"] if w["in_flight"]]
        victim = busy[0] if busy else None
    assert victim is not None, "the request never reached a worker"
    os.kill(victim, signal.SIGSTOP)
    stopped.add(victim)
    answer = await held
    answered_after = time.monotonic() - began
    document = await health(port)
    os.kill(victim, signal.SIGCONT)  # let go: it finishes the forward, and answers it too
    stopped.discard(victim)
    healthy = await _until(port, lambda h: not h["suspect_workers"], 20)
    # The log line and /health's recovery travel apart (stderr through a reader thread), so the
    # line is waited for, not looked up once.
    try:
        await asyncio.to_thread(serve.wait_for, re.escape(
            "answered again by a second worker: the later answer is dropped"), 20)
        dropped = True
    except AssertionError:
        dropped = False
    report.add("mid-forward wedge: answered after (s)", answered_after)
    report.add("mid-forward wedge: /health while stopped", document["suspect_workers"])
    report.check(answer.status == 200, "mid-forward wedge: the held request was answered 200")
    report.check(answered_after < STALL / 2,
                 "mid-forward wedge: answered by the other worker long before the stall timeout")
    report.check(healthy and dropped,
                 "mid-forward wedge: let go, the stopped worker answered too (dropped) and was "
                 "healthy again")
    report.check((await health(port))["restarts"] == restarts,
                 "mid-forward wedge: no worker killed (the stopped one was let go in time)")


async def slow_but_live(report: Report, serve: Serve) -> None:
    port = serve.port
    rounds = 1 if report.quick else 2
    restarts = (await health(port))["restarts"]
    suspects = await counter(port, "clef_worker_suspects_total")
    statuses: Counter[int] = Counter()
    long_seconds: list[float] = []
    for _ in range(rounds):
        async def long_one(n: int) -> None:
            started = time.monotonic()
            statuses[(await post(port, body(f"long{n}", LONG_WORDS), 120)).status] += 1
            long_seconds.append(time.monotonic() - started)

        async def short_ones() -> None:
            for i in range(10):
                statuses[(await post(port, body(f"short{i}"), 120)).status] += 1

        await asyncio.gather(long_one(0), long_one(1), short_ones())
    after = await health(port)
    report.add("slow but live: statuses", dict(statuses))
    latency_rows(report, "slow but live: 16k request", long_seconds)
    report.add("slow but live: workers suspected meanwhile",
               await counter(port, "clef_worker_suspects_total") - suspects)
    report.check(set(statuses) == {200}, "slow but live: every request answered 200")
    report.check(after["restarts"] == restarts, "slow but live: no worker was killed")


async def post(port: int, raw_body: bytes, timeout: float) -> HttpResponse:
    connection = Connection(port)
    try:
        return await connection.post(raw_body, timeout=timeout)
    finally:
        await connection.close()


async def counter(port: int, name: str) -> float:
    connection = Connection(port)
    try:
        text = (await connection.request("GET", "/metrics")).body.decode()
    finally:
        await connection.close()
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else -1.0


async def _killed(serve: Serve, pid: int, began: float) -> float | None:
    """Seconds from `began` until the front logs that it killed `pid`."""
    while time.monotonic() - began < STALL + 30:
        if any(f"worker pid={pid} failed" in line for line in serve.lines):
            return time.monotonic() - began
        await asyncio.sleep(0.05)  # polling the log, not a synchronisation guess
    return None


async def _replaced(port: int, pid: int, began: float) -> float | None:
    """Seconds from `began` until both workers are ready and `pid` is not one of them."""
    while time.monotonic() - began < STALL + 30:
        document = await health(port)
        pids = {w["pid"] for w in document["workers"]}
        if pid not in pids and None not in pids and not document["suspect_workers"]:
            return time.monotonic() - began
        await asyncio.sleep(0.05)  # polling /health, not a synchronisation guess
    return None


async def _until(port: int, predicate: Callable[[dict[str, Any]], bool],
                 seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate(await health(port)):
            return True
        await asyncio.sleep(0.05)  # polling /health, not a synchronisation guess
    return False


main = main_for("silent_worker", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

"""Wedged and killed workers under load, two workers, C4: each round one worker is either
stopped (SIGSTOP: it stays alive and silent, found by its missed pings within --stall-timeout)
or killed (SIGKILL). What it held is sent again: every request is answered 200, and none waits
much longer than the stall timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

from stress.common import (
    Connection,
    Report,
    clef_body,
    health,
    latency_rows,
    main_for,
)

STALL = 1.0
CLIENTS = 4


def scenario(report: Report) -> None:
    rounds = 2 if report.quick else 6
    with report.serve("--delay", "0.01", front_args=(
            "--workers", "2", "--max-batch", "2", "--stall-timeout", str(STALL),
            "--restart-backoff", "0.1")) as serve:
        statuses, latencies, done, errors = asyncio.run(run(serve.port, rounds))
        reasons = Counter(line.rsplit("reason=", 1)[1].rstrip(")")
                          for line in serve.lines if "failed after" in line and "reason=" in line)
    report.add("rounds (stop, kill alternately)", rounds)
    report.add("statuses", dict(statuses))
    report.add("workers lost, by reason", dict(reasons))
    latency_rows(report, "request", latencies)
    for error in errors[:3]:
        report.add("client error", error)
    report.check(not errors and done == rounds, "every round ran, no client error")
    report.check(set(statuses) == {200}, "every request was answered 200")
    report.check(max(latencies, default=0.0) < STALL * 4 / 3 + 3.0,
                 "no request waited much longer than the stall timeout")
    report.check(reasons["stalled"] == (rounds + 1) // 2 and reasons["crash"] == rounds // 2,
                 "each stopped worker was replaced as stalled, each killed one as crashed")


async def run(port: int, rounds: int
              ) -> tuple[Counter[int], list[float], int, list[str]]:
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    errors: list[str] = []
    stop = asyncio.Event()

    async def client(n: int) -> None:
        connection = Connection(port)
        i = 0
        try:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    answer = await connection.post(clef_body(tag=f"c{n}-{i}"), timeout=30)
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    errors.append(repr(exc))
                    return
                latencies.append(time.monotonic() - began)
                statuses[answer.status] += 1
                i += 1
        finally:
            await connection.close()


    done = 0
    clients = [asyncio.create_task(client(n)) for n in range(CLIENTS)]
    try:
        for number in range(rounds):
            document = await health(port)
            pids = {w["pid"] for w in document["workers"]}
            victim = document["workers"][number % 2]["pid"]
            await asyncio.sleep(0.3)  # let load build on the victim (pacing, not synchronisation)
            os.kill(victim, signal.SIGSTOP if number % 2 == 0 else signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not errors:
                document = await health(port)
                now = {w["pid"] for w in document["workers"]}
                if victim not in now and None not in now and len(now & pids) == 1:
                    break
                await asyncio.sleep(0.02)
            else:
                break
            done += 1
    finally:
        stop.set()
        await asyncio.gather(*clients)
    return statuses, latencies, done, errors


main = main_for("stalls", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

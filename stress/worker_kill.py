"""Worker SIGKILL under load: C8 clients keep posting while the worker is killed again and again,
each time after it served a batch. Only the request in flight may fail (500), the rest are 200 or
503 while restarting; kill-to-ready must not grow from kill to kill (the back-off resets after a
worker served, backoff.py), and each restart's logged reason says so."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections import Counter

from stress.common import Connection, Report, clef_body, health, main_for

CONCURRENCY = 8
PAUSE_ON_503 = 0.02  # a client told to retry does not spin


def scenario(report: Report) -> None:
    kills = 3 if report.quick else 8
    served_before_kill = 50 if report.quick else 100
    # The default restart back-off (0.5 s), not the test suite's shortened one.
    with report.serve(front_args=("--restart-backoff", "0.5")) as serve:
        statuses, timings, errors = asyncio.run(run(serve.port, kills, served_before_kill))
        reasons = re.findall(r"starting a new worker in ([0-9.]+)s \((.*)\)$", serve.stderr,
                             re.M)
    report.add("concurrency", CONCURRENCY)
    report.add("kills", kills)
    report.add("statuses", dict(statuses))
    for number, (served, to_ready) in enumerate(timings, 1):
        report.add(f"kill {number}: served before / kill-to-ready (s)",
                   f"{served} / {to_ready:.2f}")
    for delay, why in reasons:
        report.add("restart delay (s), reason", f"{delay}, {why}")
    for error in errors[:3]:
        report.add("client error", error)
    report.check(not errors, "no connection error or timeout")
    report.check(statuses[500] <= kills, "at most one 500 (the request in flight) per kill")
    report.check(set(statuses) <= {200, 500, 503}, "only 200, 500 and 503 answers")
    report.check(len(reasons) == kills and all(why.startswith("served") for _, why in reasons),
                 "every restart was logged as after useful work")
    ready = [seconds for _, seconds in timings]
    report.check(len(ready) == kills and max(ready) < 3 * min(ready) + 0.5,
                 "kill-to-ready did not grow from kill to kill")


async def run(port: int, kills: int, batch: int
              ) -> tuple[Counter[int], list[tuple[int, float]], list[str]]:
    statuses: Counter[int] = Counter()
    served_by: Counter[int] = Counter()
    errors: list[str] = []
    stop = asyncio.Event()

    async def client() -> None:
        connection = Connection(port)
        try:
            while not stop.is_set():
                try:
                    answer = await connection.post(clef_body())
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    errors.append(repr(exc))
                    return
                statuses[answer.status] += 1
                if answer.status == 200:
                    served_by[json.loads(answer.body)["pid"]] += 1
                elif answer.status == 503:
                    await asyncio.sleep(PAUSE_ON_503)
        finally:
            await connection.close()


    timings: list[tuple[int, float]] = []
    clients = [asyncio.create_task(client()) for _ in range(CONCURRENCY)]
    try:
        for _ in range(kills):
            pid = (await health(port))["worker"]["pid"]
            deadline = time.monotonic() + 60
            while served_by[pid] < batch and time.monotonic() < deadline and not errors:
                await asyncio.sleep(0.01)  # polling a counter, bounded by the deadline
            served = served_by[pid]
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            while time.monotonic() < killed + 60:
                document = await health(port)
                if document["status"] == "ready" and document["worker"]["pid"] != pid:
                    break
                await asyncio.sleep(0.01)
            timings.append((served, time.monotonic() - killed))
    finally:
        stop.set()
        await asyncio.gather(*clients)
    return statuses, timings, errors


main = main_for("worker_kill", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

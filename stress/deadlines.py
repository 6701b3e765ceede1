"""Deadlines under overload: C16 clients with X-Clef-Deadline-Ms: 100 against one worker that
takes 20 ms a request, one at a time. Most requests cannot be served in time: they get 504
close to their deadline, and none of them is computed (the fake worker's request log holds
exactly the answered ones)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

from stress.common import Connection, Report, clef_body, latency_rows, main_for

DEADLINE_MS = 100


def scenario(report: Report) -> None:
    seconds = 3.0 if report.quick else 10.0
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "requests.log"
        with report.serve("--delay", "0.02", "--log-file", str(log),
                          front_args=("--max-batch", "1", "--queue-size", "256")) as serve:
            statuses, expired = asyncio.run(run(serve.port, seconds))
        computed = len(log.read_text().split()) if log.exists() else 0
    report.add("seconds", seconds)
    report.add("statuses", dict(statuses))
    report.add("requests the worker computed", computed)
    latency_rows(report, "504", expired)
    report.check(set(statuses) <= {200, 504} and statuses[504] > 0,
                 "only 200 and 504, and some deadlines passed")
    report.check(computed == statuses[200], "no request past its deadline was computed")
    report.check(max(expired, default=0.0) < DEADLINE_MS / 1000 + 1.0,
                 "every 504 came within a second of its deadline")


async def run(port: int, seconds: float) -> tuple[Counter[int], list[float]]:
    statuses: Counter[int] = Counter()
    expired: list[float] = []
    stop = time.monotonic() + seconds

    deadline = (("X-Clef-Deadline-Ms", str(DEADLINE_MS)),)

    async def client(n: int) -> None:
        connection = Connection(port)
        try:
            i = 0
            while time.monotonic() < stop:
                began = time.monotonic()
                answer = await connection.request("POST", "/v1/systemone",
                                                  clef_body(tag=f"c{n}-{i}"), deadline)
                statuses[answer.status] += 1
                if answer.status == 504:
                    expired.append(time.monotonic() - began)
                i += 1
        finally:
            await connection.close()

    await asyncio.gather(*(client(n) for n in range(16)))
    return statuses, expired


main = main_for("deadlines", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

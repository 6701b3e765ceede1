"""A hung worker: a request the worker never answers (the fake worker holds it on a file that
is never created) must get 500 once --request-timeout passes, the worker must be replaced, and
a good client must be served again afterwards; meanwhile it gets 503, never a hang."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from stress.common import Connection, Report, clef_body, main_for

REQUEST_TIMEOUT = 1.0


def scenario(report: Report) -> None:
    hangs = 1 if report.quick else 3
    with tempfile.TemporaryDirectory() as scratch, report.serve(
        front_args=("--request-timeout", str(REQUEST_TIMEOUT))
    ) as serve:
        never = Path(scratch) / "never created"
        rows, good = asyncio.run(run(serve.port, hangs, never))
    report.add("request timeout (s)", REQUEST_TIMEOUT)
    for number, (status, to_answer, to_ready) in enumerate(rows, 1):
        report.add(f"hang {number}: status / s to answer / s to ready",
                   f"{status} / {to_answer:.2f} / {to_ready:.2f}")
    report.add("good client statuses", dict(good))
    report.check(len(rows) == hangs and all(status == 500 for status, _, _ in rows),
                 "every hung request got 500")
    # A hung request is sent again once (a lost worker's requests are), so it hangs a second
    # worker before its 500: two request timeouts.
    report.check(all(to_answer < 2 * REQUEST_TIMEOUT + 2 for _, to_answer, _ in rows),
                 "each 500 came soon after two request timeouts")
    report.check(all(to_ready < 10 for _, _, to_ready in rows),
                 "a replacement was ready within 10 s each time")
    # With several requests in flight per worker (the default), a good request in flight
    # beside the hung one is lost with it and sent again; the hung one, resent first and alone,
    # can hold the replacement past the good one's resend bound (--request-timeout): 504.
    report.check(set(good) <= {200, 503, 504} and good[200] > 0,
                 "the good client got only 200, 503 and 504, and was served")


async def run(port: int, hangs: int, never: Path
              ) -> tuple[list[tuple[int, float, float]], Counter[int]]:
    good: Counter[int] = Counter()
    stop = asyncio.Event()

    async def good_client() -> None:
        connection = Connection(port)
        try:
            while not stop.is_set():
                good[(await connection.post(clef_body(tag="good"))).status] += 1
                await asyncio.sleep(0.02)  # a steady trickle of traffic, not a synchronisation
        finally:
            await connection.close()

    async def ready_pid() -> int | None:
        probe = Connection(port)
        try:
            document = json.loads((await probe.request("GET", "/health")).body)
        finally:
            await probe.close()
        return document["worker"]["pid"] if document["status"] == "ready" else None

    rows: list[tuple[int, float, float]] = []
    background = asyncio.create_task(good_client())
    try:
        for _ in range(hangs):
            pid = await ready_pid()
            started = time.monotonic()
            stuck = Connection(port)
            answer = await stuck.post(clef_body(tag="stuck", hold_until=str(never)), timeout=30)
            await stuck.close()
            answered = time.monotonic() - started
            while time.monotonic() < started + 30:
                now_pid = await ready_pid()
                if now_pid is not None and now_pid != pid:
                    break
                await asyncio.sleep(0.01)
            rows.append((answer.status, answered, time.monotonic() - started))
        good_before = good[200]
        while good[200] == good_before and time.monotonic() < started + 30:
            await asyncio.sleep(0.01)  # until the good client was served by the replacement
    finally:
        stop.set()
        await background
    return rows, good


main = main_for("hung_worker", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

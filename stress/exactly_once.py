"""Exactly once under load: C32 keep-alive clients, every request tagged, every tag answered
once to its own client and seen once by the worker (no loss, no duplicate, no cross-talk)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

from stress.common import Connection, Report, clef_body, latency_rows, main_for

CONCURRENCY = 32


def scenario(report: Report) -> None:
    total = 1_600 if report.quick else 10_000
    with tempfile.TemporaryDirectory() as scratch:
        worker_log = Path(scratch) / "tags"
        with report.serve("--log-file", str(worker_log)) as serve:
            answers, seconds, wall = asyncio.run(load(serve.port, total))
        seen = Counter(worker_log.read_text().split())
    tags = [f"c{client}-{n}" for client in range(CONCURRENCY)
            for n in range(total // CONCURRENCY)]
    report.add("requests", len(tags))
    report.add("concurrency", CONCURRENCY)
    report.add("requests/s", len(tags) / wall)
    latency_rows(report, "latency", seconds)
    statuses = Counter(status for status, _ in answers.values())
    report.add("statuses", dict(statuses))
    wrong = [tag for tag, (status, got) in answers.items() if status != 200 or got != tag]
    report.check(len(answers) == len(tags), "every request got an answer")
    report.check(not wrong, f"every answer is a 200 carrying its own tag ({len(wrong)} not)")
    report.check(all(seen[tag] == 1 for tag in tags) and sum(seen.values()) == len(tags),
                 "the worker saw every tag exactly once")


async def load(port: int, total: int) -> tuple[dict[str, tuple[int, str | None]], list[float],
                                                   float]:
    answers: dict[str, tuple[int, str | None]] = {}
    seconds: list[float] = []

    async def client(number: int) -> None:
        connection = Connection(port)
        try:
            for n in range(total // CONCURRENCY):
                tag = f"c{number}-{n}"
                started = time.monotonic()
                answer = await connection.post(clef_body(tag=tag))
                seconds.append(time.monotonic() - started)
                got = json.loads(answer.body).get("tag") if answer.status == 200 else None
                answers[tag] = (answer.status, got if isinstance(got, str) else None)
        finally:
            await connection.close()

    started = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(CONCURRENCY)))
    return answers, seconds, time.monotonic() - started


main = main_for("exactly_once", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

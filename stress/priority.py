"""Interactive latency under a bulk flood: C8 bulk clients keep one worker (one request in
flight, 10 ms each) saturated while one interactive client sends requests one after another.
The interactive requests must wait far less than the bulk ones (they are admitted first), and
the bulk flood must still move (one admission in every BULK_EVERY)."""

from __future__ import annotations

import asyncio
import time

from stress.common import (
    Connection,
    Report,
    clef_body,
    latency_rows,
    main_for,
    percentile,
)

BULK = [("X-Clef-Priority", "bulk")]


def scenario(report: Report) -> None:
    seconds = 3.0 if report.quick else 10.0
    with report.serve("--delay", "0.01", front_args=("--max-batch", "1",
                                                     "--queue-size", "256")) as serve:
        interactive, bulk, statuses = asyncio.run(run(serve.port, seconds))
    report.add("seconds", seconds)
    report.add("statuses", statuses)
    latency_rows(report, "interactive", interactive)
    latency_rows(report, "bulk", bulk)
    report.check(statuses == {200}, "every request was answered 200")
    report.check(len(interactive) > 10 and len(bulk) > 10, "both classes were served")
    report.check(percentile(interactive, 0.5) * 3 < percentile(bulk, 0.5),
                 "interactive p50 latency is under a third of bulk's")


async def run(port: int, seconds: float) -> tuple[list[float], list[float], set[int]]:
    interactive: list[float] = []
    bulk: list[float] = []
    statuses: set[int] = set()
    stop = time.monotonic() + seconds

    async def client(tag: str, headers: list[tuple[str, str]], latencies: list[float]) -> None:
        connection = Connection(port)
        try:
            i = 0
            while time.monotonic() < stop:
                began = time.monotonic()
                answer = await connection.request("POST", "/v1/systemone",
                                                  clef_body(tag=f"{tag}-{i}"), tuple(headers),
                                                  timeout=60)
                latencies.append(time.monotonic() - began)
                statuses.add(answer.status)
                i += 1
        finally:
            await connection.close()

    await asyncio.gather(*(client(f"bulk{n}", BULK, bulk) for n in range(8)),
                         client("interactive", [], interactive))
    return interactive, bulk, statuses


main = main_for("priority", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

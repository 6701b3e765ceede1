"""Slow connections against a good client: many clients trickle their heads or their bodies one
byte at a time while one good client keeps posting. The good client must be served throughout
(latency reported), every trickled body must get 408 from the minimum body rate (body_rate.py)
soon after its grace period, and every trickled head must be dropped at the header timeout."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from stress.common import (
    HOST,
    Connection,
    Report,
    build_request,
    clef_body,
    latency_rows,
    main_for,
    read_answer,
)

BYTE_EVERY = 0.2  # seconds between trickled bytes: 5 B/s, far under any minimum rate


def scenario(report: Report) -> None:
    slow = 40 if report.quick else 500
    header_timeout, grace = (2.0, 2.0) if report.quick else (10.0, 5.0)
    front = ("--header-timeout", str(header_timeout), "--body-rate-grace", str(grace),
             "--body-timeout", "30", "--body-min-rate", "1024")
    with report.serve(front_args=front) as serve:
        heads, bodies, good, seconds = asyncio.run(run(serve.port, slow, header_timeout + 10))
    report.add("slow connections (heads + bodies)", f"{slow // 2} + {slow - slow // 2}")
    report.add("header timeout / body rate grace (s)", f"{header_timeout:g} / {grace:g}")
    report.add("trickled heads: outcome", dict(Counter(outcome for outcome, _ in heads)))
    report.add("trickled heads: longest (s)", max((s for _, s in heads), default=0.0))
    report.add("trickled bodies: outcome", dict(Counter(outcome for outcome, _ in bodies)))
    report.add("trickled bodies: longest (s)", max((s for _, s in bodies), default=0.0))
    report.add("good client requests", sum(good.values()))
    latency_rows(report, "good client", seconds)
    report.check(all(outcome == "dropped" for outcome, _ in heads)
                 and all(s < header_timeout + 2 for _, s in heads),
                 "every trickled head was dropped at the header timeout")
    report.check(all(outcome == "408" for outcome, _ in bodies)
                 and all(s < grace + 2 for _, s in bodies),
                 "every trickled body got 408 soon after the grace period")
    report.check(set(good) == {200} and sum(good.values()) > 0,
                 "the good client got only 200s throughout")


async def trickle(port: int, prefix: bytes, rest: bytes, limit: float) -> tuple[str, float]:
    """Send `prefix`, then `rest` a byte at a time until the server answers or closes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    started = time.monotonic()
    answer = asyncio.create_task(read_answer(reader))
    try:
        writer.write(prefix)
        for byte in rest:  # bounded by len(rest) and by `limit`
            if answer.done() or time.monotonic() - started > limit:
                break
            writer.write(bytes([byte]))
            await asyncio.wait({answer}, timeout=BYTE_EVERY)
        try:
            got = await asyncio.wait_for(answer, max(limit - (time.monotonic() - started), 0.1))
            outcome = str(got.status)
        except (asyncio.IncompleteReadError, ConnectionError):
            outcome = "dropped"
        except TimeoutError:
            outcome = "still open"
        return outcome, time.monotonic() - started
    finally:
        answer.cancel()
        writer.close()


async def run(port: int, slow: int, limit: float
              ) -> tuple[list[tuple[str, float]], list[tuple[str, float]], Counter[int],
                         list[float]]:
    body = clef_body(state="x" * 100_000)
    post = build_request("POST", "/v1/systemone", body)
    # Long enough that, a byte at a time, it would outlast any header timeout used here.
    get = build_request("GET", "/health", headers=[("X-Pad", "p" * 200)])
    good: Counter[int] = Counter()
    seconds: list[float] = []
    stop = asyncio.Event()

    async def good_client() -> None:
        connection = Connection(port)
        try:
            while not stop.is_set():
                started = time.monotonic()
                good[(await connection.post(clef_body(tag="good"))).status] += 1
                seconds.append(time.monotonic() - started)
                await asyncio.sleep(0.01)  # a steady client, not a synchronisation
        finally:
            await connection.close()

    steady = asyncio.create_task(good_client())
    try:
        heads = [trickle(port, b"", get, limit) for _ in range(slow // 2)]
        bodies = [trickle(port, post[: -len(body)], body, limit) for _ in range(slow - slow // 2)]
        outcomes = await asyncio.gather(*heads, *bodies)
    finally:
        stop.set()
        await steady
    return outcomes[: slow // 2], outcomes[slow // 2:], good, seconds


main = main_for("slow_clients", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

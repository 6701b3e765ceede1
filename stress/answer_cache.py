"""Duplicates under load: C8 clients send, over and over, one of five distinct requests (an
eval re-run, retries). With the answer cache on, each distinct request is computed once: the
fake worker's request log holds five lines, and every answer is 200 and that request's.

Then sharing never turns a 200 into a 504: with `--max-batch 1` (no room, so they join) a
request whose forward takes a second is joined by identical ones with `X-Clef-Deadline-Ms: 200`;
their deadlines pass while the forward is on the worker, where a request is never expired, so
each gets the shared 200 with the first, and the request is computed once."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from stress.common import Connection, Report, clef_body, latency_rows, main_for

DISTINCT = 5
JOINERS = 4
FORWARD_S = 1.0
JOINER_DEADLINE_MS = 200


def scenario(report: Report) -> None:
    rounds = 25 if report.quick else 250
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "requests.log"
        with report.serve("--delay", "0.01", "--log-file", str(log),
                          front_args=("--max-batch", "4")) as serve:
            statuses, mismatched, lookups = asyncio.run(run(serve.port, rounds))
        computed = Counter(log.read_text().split())
    report.add("requests", sum(statuses.values()))
    report.add("statuses", dict(statuses))
    report.add("forwards by request", dict(computed))
    report.add("lookups", lookups)
    report.check(statuses == Counter({200: 8 * rounds}), "every request was answered 200")
    report.check(mismatched == 0, "every answer was its own request's")
    report.check(computed == Counter({f"q{i}": 1 for i in range(DISTINCT)}),
                 "each distinct request was computed exactly once")
    report.check(lookups.get("miss") == DISTINCT and sum(lookups.values()) == 8 * rounds,
                 "the cache counted one miss per distinct request and a lookup per request")
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "requests.log"
        with report.serve("--log-file", str(log), front_args=("--max-batch", "1")) as serve:
            first, joiners = asyncio.run(join_with_deadlines(serve.port))
            lookups = asyncio.run(cache_lookups(serve.port))
        forwards = log.read_text().split()
    report.add("shared forward: status, seconds", f"{first[0]}, {first[1]:.2f}")
    report.add("joiners' statuses", dict(Counter(status for status, _ in joiners)))
    latency_rows(report, "joiner 200", [seconds for _, seconds in joiners])
    report.check(all(status == 200 for status, _ in joiners)
                 and lookups.get("coalesced") == JOINERS,
                 f"every joiner with a {JOINER_DEADLINE_MS} ms deadline got the shared 200")
    report.check(first[0] == 200 and first[1] >= FORWARD_S and forwards == ["slow"],
                 "the shared forward answered the first request and its joiners, computed once")


async def metric_samples(port: int) -> list[Any]:
    """Every sample of /metrics, parsed."""
    probe = Connection(port)
    try:
        text = (await probe.request("GET", "/metrics")).body.decode()
    finally:
        await probe.close()
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


async def gauge(port: int, name: str) -> float:
    """One unlabelled gauge's value."""
    return next(sample.value for sample in await metric_samples(port) if sample.name == name)


async def cache_lookups(port: int) -> dict[str, int]:
    """`clef_answer_cache_total` by result."""
    return {sample.labels["result"]: int(sample.value) for sample in await metric_samples(port)
            if sample.name == "clef_answer_cache_total"}


async def run(port: int, rounds: int) -> tuple[Counter[int], int, dict[str, int]]:
    statuses: Counter[int] = Counter()
    mismatched = 0
    # One body per distinct request, sent again and again (clef_body numbers each body it makes).
    bodies = {f"q{i}": clef_body(tag=f"q{i}") for i in range(DISTINCT)}

    async def client(n: int) -> None:
        nonlocal mismatched
        connection = Connection(port)
        try:
            for i in range(rounds):
                tag = f"q{(n + i) % DISTINCT}"
                answer = await connection.post(bodies[tag])
                statuses[answer.status] += 1
                if answer.status == 200 and json.loads(answer.body)["tag"] != tag:
                    mismatched += 1
        finally:
            await connection.close()

    await asyncio.gather(*(client(n) for n in range(8)))
    return statuses, mismatched, await cache_lookups(port)


async def join_with_deadlines(port: int) -> tuple[tuple[int, float], list[tuple[int, float]]]:
    """The first request's (status, seconds) and each joiner's."""
    body = clef_body(tag="slow", sleep=FORWARD_S)
    timed = Connection(port)

    async def send(headers: list[tuple[str, str]], connection: Connection) -> tuple[int, float]:
        began = asyncio.get_running_loop().time()
        answer = await connection.request("POST", "/v1/systemone", body, headers=tuple(headers))
        return answer.status, asyncio.get_running_loop().time() - began

    connections = [Connection(port) for _ in range(JOINERS)]
    try:
        first = asyncio.ensure_future(send([], timed))
        # The first is on the worker (a lookup is counted when its answer lands, so the
        # cache's counter cannot say so; the in-flight gauge can).
        while await gauge(port, "clef_requests_in_flight") < 1:
            await asyncio.sleep(0.01)
        deadline = [("X-Clef-Deadline-Ms", str(JOINER_DEADLINE_MS))]
        joiners = await asyncio.gather(*(send(deadline, c) for c in connections))
        return await first, joiners
    finally:
        for connection in (timed, *connections):
            await connection.close()


main = main_for("answer_cache", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

"""A closed loop of HTTP clients: each sends its next request when its answer is in.

The one load loop of the project: `clef-bench` runs it for a number of requests per
concurrency level, the benchmarks' fallback when wrk is absent (`benchlib.http_load`) for a
number of seconds. Closed, like the server's real clients: the offered load follows the
answers, so a slow server is measured, not buried under a queue the load generator built.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import h11

from clef_tools.http_client import Endpoint, HttpConnection

# What a failed exchange raises: the socket, h11 (a malformed answer), or the timeout.
EXCHANGE_ERRORS = (OSError, h11.ProtocolError, TimeoutError)


@dataclass(frozen=True)
class Sample:
    """One request: its outcome (the status as text, or the exception's name) and its time."""

    outcome: str
    ms: float


@dataclass(frozen=True)
class LoopRun:
    samples: list[Sample]  # in the order the requests finished
    wall_s: float


async def closed_loop(endpoint: Endpoint, method: str, target: str,
                      bodies: Callable[[int], bytes], *, clients: int,
                      requests: int | None = None, seconds: float | None = None, first: int = 0,
                      headers: tuple[tuple[str, str], ...] = (), timeout: float = 60.0,
                      on_answer: Callable[[], None] | None = None) -> LoopRun:
    """`clients` keep-alive clients send `requests` requests in all (numbered from `first`,
    each client taking the next number), or as many as they can for `seconds`; `bodies(n)` is
    request n's body. A failed exchange is a sample too (its exception's name), never raised."""
    if (requests is None) == (seconds is None):
        raise ValueError("give either requests or seconds")
    numbers: Iterator[int] = (iter(range(first, first + requests)) if requests is not None
                              else itertools.count(first))
    deadline = None if seconds is None else time.perf_counter() + seconds
    samples: list[Sample] = []

    async def client() -> None:
        connection = HttpConnection(endpoint, timeout)
        try:
            for number in numbers:  # one iterator shared by every client: each sent once
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                body = bodies(number)
                started = time.perf_counter()
                try:
                    answer = await connection.request(method, target, body, headers)
                    outcome = str(answer.status)
                except EXCHANGE_ERRORS as exc:
                    outcome = type(exc).__name__
                samples.append(Sample(outcome, (time.perf_counter() - started) * 1000.0))
                if on_answer is not None:
                    on_answer()
        finally:
            await connection.close()

    count = clients if requests is None else min(clients, requests)
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(count)))
    return LoopRun(samples, time.perf_counter() - started)

"""Raw-socket HTTP fuzz: a seeded mutator turns well-formed requests into broken ones (flipped,
inserted, deleted and duplicated bytes and lines, hostile framing headers, truncation) and sends
each on its own connection. No answer may be a 5xx other than 503, the worker must never see a
request the front should have refused (its pid never changes), and the front's memory must stay
flat. The seed is printed: a failure replays with `--seed`."""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Callable

from stress.common import (
    HOST,
    Report,
    build_request,
    clef_body,
    main_for,
    raise_fd_limit,
    rss_kib,
)

CONCURRENCY = 32
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
SEED = 20261130

SEEDS = [
    build_request("GET", "/health"),
    build_request("POST", "/v1/systemone", clef_body(tag="fuzz")),
    build_request("POST", "/v1/systemone", b'{"model": "m", "state": "s", "questions": {}}'),
    build_request("GET", "/health") + build_request("POST", "/v1/systemone", clef_body()),
    build_request("POST", "/v1/systemone", clef_body(), headers=[("Expect", "100-continue")]),
    build_request("PUT", "/nope?x=1", b"", version="HTTP/1.0"),
]
HOSTILE_LINES = [
    b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"Transfer-Encoding: identity",
    b"Content-Length: -1", b"Content-Length: +2", b"Content-Length: 99999999999999999999",
    b"Content-Length: 5", b"Content-Length: 0", b"Content-Length: abc", b"Host: a",
    b"Host:", b"Content-Type: text/plain", b"Connection: close", b"Expect: 100-continue",
    b"X-Folded: a\r\n continued", b"Bad Header", b":empty", b"X-Nul: \x00",
    b"X-Big: " + b"b" * 20000,
]
JUNK = [b"\r\n", b"\n", b"\r", b" ", b":", b"\x00", b"\xff", b"{", b"}", b"\"", b"\t", b"0"]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four random mutations of `data`."""
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(7)
        at = rng.randrange(len(data) + 1)
        if choice == 0 and data:  # flip a byte
            at = min(at, len(data) - 1)
            data = data[:at] + bytes([rng.randrange(256)]) + data[at + 1:]
        elif choice == 1:  # insert junk
            data = data[:at] + rng.choice(JUNK) * rng.randint(1, 3) + data[at:]
        elif choice == 2:  # delete a range
            data = data[:at] + data[at + rng.randint(1, 16):]
        elif choice == 3:  # add a hostile header line after the request line
            end = data.find(b"\r\n")
            if end >= 0:
                data = data[: end + 2] + rng.choice(HOSTILE_LINES) + b"\r\n" + data[end + 2:]
        elif choice == 4:  # duplicate a line
            lines = data.split(b"\r\n")
            pick = rng.randrange(len(lines))
            lines.insert(pick, lines[pick])
            data = b"\r\n".join(lines)
        elif choice == 5:  # truncate
            data = data[:at]
        else:  # swap the case of a stretch
            data = data[:at] + data[at: at + 12].swapcase() + data[at + 12:]
    return data


async def one_case(port: int, data: bytes) -> list[int] | str:
    """Send one case, half-close, read until EOF: the statuses answered, or what went wrong."""
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as exc:
        return f"connect failed: {exc!r}"
    try:
        writer.write(data)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # EOF: a stalled head or body ends at once, not at a timeout
        received = await asyncio.wait_for(reader.read(), 15)
    except (ConnectionError, asyncio.IncompleteReadError):
        return []  # the server may reset a connection it refused; what it answered is lost
    except TimeoutError:
        return "no EOF within 15 s"
    finally:
        writer.close()
    return [int(status) for status in STATUS_LINE.findall(received)]


async def run(port: int, cases: int, seed: int) -> tuple[Counter[str], list[str], float]:
    rng = random.Random(seed)
    statuses: Counter[str] = Counter()
    problems: list[str] = []
    todo = [(n, mutate(rng, rng.choice(SEEDS))) for n in range(cases)]
    started = time.monotonic()

    async def lane(cases_here: list[tuple[int, bytes]]) -> None:
        for number, data in cases_here:
            outcome = await one_case(port, data)
            if isinstance(outcome, str):
                problems.append(f"case {number}: {outcome}")
                continue
            if not outcome:
                statuses["closed without answer"] += 1
            for status in outcome:
                statuses[str(status)] += 1
                if status >= 500 and status != 503:
                    problems.append(f"case {number}: {status} for {data[:120]!r}")

    await asyncio.gather(*(lane(todo[i::CONCURRENCY]) for i in range(CONCURRENCY)))
    return statuses, problems, time.monotonic() - started


def make_scenario(seed: int) -> Callable[[Report], None]:
    def scenario(report: Report) -> None:
        cases = 2_000 if report.quick else 20_000
        front = ("--header-timeout", "2", "--body-timeout", "2", "--keepalive-timeout", "2")
        with report.serve(front_args=front) as serve:
            pid = serve.process.pid
            worker = serve.health().json()["worker"]["pid"]
            # Warm up first, so the memory comparison is not a start-up allocation.
            asyncio.run(run(serve.port, 200, seed + 1))
            before = rss_kib(pid)
            statuses, problems, wall = asyncio.run(run(serve.port, cases, seed))
            after = rss_kib(pid)
            health = serve.health()
        report.add("seed", seed)
        report.add("cases", cases)
        report.add("cases/s", cases / wall)
        report.add("answers by status", dict(sorted(statuses.items())))
        report.add("front RSS before / after (KiB)", f"{before} / {after}")
        for problem in problems[:5]:
            report.add("problem", problem)
        report.check(not problems, f"no 5xx but 503, no hang ({len(problems)} cases broke it)")
        report.check(health.status == 200 and health.json()["worker"]["pid"] == worker,
                     "still healthy afterwards, same worker")
        report.check(after - before < 20 * 1024, "front memory grew by under 20 MiB")

    return scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stress.fuzz")
    parser.add_argument("--quick", action="store_true", help="the short CI run")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    raise_fd_limit()
    return main_for("fuzz", make_scenario(args.seed))(["--quick"] if args.quick else [])


if __name__ == "__main__":
    raise SystemExit(main(None))

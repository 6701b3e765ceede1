"""A burst of idle connections: thousands of clients connect at once and send nothing. Every
connect must succeed (the listen backlog, --backlog, absorbs the burst), a good client must still
be served while they sit there, and the server must close every idle one at the keep-alive
timeout. The host's listen-queue overflow counter (TcpExtListenOverflows, host-wide) is reported."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

from stress.common import HOST, Connection, Report, clef_body, latency_rows, main_for

KEEPALIVE = 2.0


def listen_overflows() -> int | None:
    """TcpExtListenOverflows from /proc/net/netstat (counts every socket on the host)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(table["ListenOverflows"]) if "ListenOverflows" in table else None
    return None


def scenario(report: Report) -> None:
    burst = 300 if report.quick else 2_000
    with report.serve(front_args=("--keepalive-timeout", str(KEEPALIVE))) as serve:
        before = listen_overflows()
        connected, failures, closed, good, seconds, burst_s = asyncio.run(run(serve.port, burst))
        after = listen_overflows()
        healthy = serve.health().status == 200
    report.add("burst connections", burst)
    report.add("connected / failed", f"{connected} / {len(failures)}")
    report.add("burst connect time (s)", burst_s)
    report.add("closed by the server by keep-alive + 3 s", closed)
    report.add("good client statuses", dict(good))
    latency_rows(report, "good client", seconds)
    if before is not None and after is not None:
        report.add("host ListenOverflows during the run", after - before)
    for failure in failures[:3]:
        report.add("connect error", failure)
    report.check(connected == burst and not failures, "every connection was accepted")
    report.check(set(good) == {200}, "the good client got only 200s during the burst")
    report.check(closed == connected, "the server closed every idle connection")
    report.check(healthy, "still healthy afterwards")


async def run(port: int, burst: int
              ) -> tuple[int, list[str], int, Counter[int], list[float], float]:
    started = time.monotonic()
    opened = await asyncio.gather(*(asyncio.open_connection(HOST, port) for _ in range(burst)),
                                  return_exceptions=True)
    burst_s = time.monotonic() - started
    streams = [item for item in opened if isinstance(item, tuple)]
    failures = [repr(item) for item in opened if not isinstance(item, tuple)]
    good: Counter[int] = Counter()
    seconds: list[float] = []
    connection = Connection(port)
    try:
        for _ in range(50):
            began = time.monotonic()
            good[(await connection.post(clef_body(tag="good"))).status] += 1
            seconds.append(time.monotonic() - began)
    finally:
        await connection.close()

    async def closed_by_server(reader: asyncio.StreamReader) -> bool:
        try:
            return await asyncio.wait_for(reader.read(1), KEEPALIVE + 3) == b""
        except (TimeoutError, ConnectionError):
            return False

    closed = sum(await asyncio.gather(*(closed_by_server(reader) for reader, _ in streams)))
    for _, writer in streams:
        writer.close()
    return len(streams), failures, closed, good, seconds, burst_s


main = main_for("idle_burst", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

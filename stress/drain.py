"""SIGTERM with a full queue: one request held in flight and the queue filled to --queue-size,
then SIGTERM; every queued request must still be answered 200, new connections refused, and the
server must exit 0."""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from pathlib import Path

from stress.common import Connection, Report, Serve, clef_body, health, main_for


def scenario(report: Report) -> None:
    queue_size = 64  # the default --queue-size, full, in both modes (it takes under a second)
    # One request in flight (held at the worker) so the rest visibly fill the queue.
    with tempfile.TemporaryDirectory() as scratch, report.serve(
        front_args=("--queue-size", str(queue_size), "--drain-timeout", "30", "--max-batch", "1")
    ) as serve:
        gate = Path(scratch) / "gate"
        statuses, refused, drain_s = asyncio.run(run(serve, queue_size, gate))
        code = serve.wait_exit(30)
    report.add("queue size", queue_size)
    report.add("statuses", dict(statuses))
    report.add("SIGTERM to exit (s)", drain_s)
    report.add("exit code", code)
    report.check(statuses[200] == queue_size + 1, "the request in flight and every queued one "
                 "got 200")
    report.check(refused, "a new connection after SIGTERM was refused")
    report.check(code == 0, "the server exited 0")


async def run(serve: Serve, queue_size: int, gate: Path) -> tuple[Counter[int], bool, float]:

    async def wait_health(predicate: str, value: int) -> None:
        deadline = time.monotonic() + 30
        while (await health(serve.port))[predicate] != value:
            if time.monotonic() > deadline:
                raise TimeoutError(f"/health never showed {predicate}={value}")
            await asyncio.sleep(0.01)

    async def post(tag: str) -> int:
        connection = Connection(serve.port)
        try:
            return (await connection.post(clef_body(tag=tag, hold_until=str(gate)),
                                          timeout=60)).status
        finally:
            await connection.close()

    calls = [asyncio.create_task(post("held"))]
    await wait_health("in_flight", 1)
    calls += [asyncio.create_task(post(f"q{n}")) for n in range(queue_size)]
    await wait_health("queue_depth", queue_size)
    started = time.monotonic()
    serve.terminate()
    serve.wait_for("draining: ")
    try:
        await asyncio.open_connection("127.0.0.1", serve.port)
        refused = False
    except OSError:
        refused = True
    gate.touch()  # let the worker go: the held request, then the queue, then shutdown
    statuses = Counter(await asyncio.gather(*calls))
    await asyncio.to_thread(serve.wait_exit, 30)
    return statuses, refused, time.monotonic() - started


main = main_for("drain", scenario)

if __name__ == "__main__":
    raise SystemExit(main(None))

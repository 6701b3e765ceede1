"""End-to-end latency through `clef-serve`: HTTP, validation, admission, frames, worker, model.

Not a test. Starts the server as a subprocess on a free loopback port with the given flags,
waits for it to listen, sends `--requests` requests over one keep-alive connection (sequential:
the per-request cost), then the same number spread over `--clients` concurrent connections
(FIFO admission: throughput stays that of one worker, latency grows with the queue), and prints
percentiles as JSON.

`--zero-work` measures the front alone instead: clef-serve with tests/fake_worker.py (a worker
that does no work), `GET /health` (no worker hop) beside `POST /v1/systemone`, and uvicorn serving
a zero-work ASGI app (benchlib/zero_work_app.py) when uvicorn is installed, each at 1 connection and
at 32; it prints the table, and with `--write-docs` puts it in docs/benchmarks.md
(see benchlib/zero_work.py).

    python bench/bench_http.py -- --model demo --device cpu
    python bench/bench_http.py --requests 200 -- --model demo --device cuda
    python bench/bench_http.py --zero-work
    python bench/bench_http.py --quick          # a few seconds, writes nothing (CI smoke run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.docs_writer import add_write_docs_flag
from benchlib.http_client import Client
from benchlib.provenance import command_line
from benchlib.serve import Serve
from benchlib.timing import latency_summary, percentile, timed_ms

REQUEST = {
    "model": "clef-flash",
    "state": "Invoice #4411 from Acme for $12,400 was due on 2026-09-30 and is still unpaid. "
             "The customer says the payment was sent last week from a new bank account.",
    "questions": {
        "status": {"type": "choice", "instructions": "What is the payment status?",
                   "criteria": {"paid": "settled", "pending": "not yet due",
                                "overdue": "past due"}},
        "large": {"type": "noul", "instructions": "Is the amount above $10,000?"},
        "risk": {"type": "score", "instructions": "How risky is this account?",
                 "criteria": ["low", "medium", "high"]},
    },
}


def percentiles(samples: list[float]) -> dict[str, float]:
    """The latency figures this benchmark reports (benchlib.timing's percentiles, plus p95)."""
    summary = latency_summary(samples)
    return {"n": len(samples), "p50_ms": summary["p50_ms"],
            "p95_ms": round(percentile(samples, 0.95), 2), "p99_ms": summary["p99_ms"],
            "max_ms": summary["max_ms"]}


def numbered_body(number: int) -> bytes:
    """REQUEST with its state numbered: every body distinct, so with the server's default
    answer cache each request is a forward, not a cache hit."""
    return json.dumps({**REQUEST, "state": f"{REQUEST['state']} (request {number})"}).encode()


def post(client: Client, body: bytes) -> float:
    """One POST over `client`'s keep-alive connection, timed to the end of the answer."""
    def call() -> None:
        client.send("POST", "/v1/systemone", body)
        response = client.read_response()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")

    return timed_ms(call)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--zero-work", action="store_true",
                        help="measure the front with a zero-work worker, beside uvicorn")
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="--zero-work: seconds of load per row and concurrency")
    parser.add_argument("--no-wrk", action="store_true",
                        help="--zero-work: use the asyncio load generator even if wrk exists")
    add_write_docs_flag(parser)
    parser.add_argument("--quick", action="store_true",
                        help="tiny run, writes nothing; without server flags, a zero-work run")
    parser.add_argument("server_args", nargs="*", help="flags for clef-serve (after --)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.clients, args.seconds, args.write_docs = 5, 2, 1.0, False
        args.zero_work = args.zero_work or not args.server_args
    if args.zero_work:
        from benchlib.zero_work import run_zero_work

        return run_zero_work(args)
    results: dict[str, Any] = {"command": command_line(__file__)}
    with Serve(front_args=tuple(args.server_args), real_worker=True, max_batch=None,
               startup_wait=args.startup_timeout) as server:
        numbers = itertools.count()
        with server.connect(timeout=60) as client:
            for _ in range(5):
                post(client, numbered_body(next(numbers)))
            results["sequential"] = percentiles([post(client, numbered_body(next(numbers)))
                                                 for _ in range(args.requests)])
        samples: list[float] = []
        lock = threading.Lock()
        per_client = max(1, args.requests // args.clients)
        bodies = [[numbered_body(next(numbers)) for _ in range(per_client)]
                  for _ in range(args.clients)]

        def one_client(mine_to_send: list[bytes]) -> None:
            with server.connect(timeout=120) as client:
                mine = [post(client, body) for body in mine_to_send]
            with lock:
                samples.extend(mine)

        sequential_lines = len(server.lines)
        started = time.perf_counter()
        threads = [threading.Thread(target=one_client, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - started
        results["concurrent"] = {**percentiles(samples), "clients": args.clients,
                                 "throughput_rps": round(len(samples) / elapsed, 1)}
        log_lines = list(server.lines)
    worker_ms = [float(m.group(1)) for line in log_lines
                 if (m := re.search(r"worker_ms=([\d.]+)", line))]
    if worker_ms:
        results["worker_ms"] = percentiles(worker_ms)
    # Requests per worker forward in the concurrent phase, as the access log says (`batch=`).
    batches = [int(m.group(1)) for line in log_lines[sequential_lines:]
               if (m := re.search(r" batch=(\d+) ", line))]
    if batches:
        results["batch_size"] = {"mean": round(statistics.mean(batches), 2),
                                 "max": max(batches),
                                 "requests_alone": sum(1 for b in batches if b == 1)}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`clef-bench URL --requests N --concurrency C [C ...] --out DIR`: load a running server.

For operators sizing a deployment: for each concurrency level, C clients on keep-alive
connections send N requests in all, each client sending its next request when its answer is
in (a closed loop, like the server's real clients). The result is `DIR/report.json` (the
server's `/health`, then one row per level: throughput and latency percentiles) and
`DIR/latency.png`. The levels run one after another against the same server, so a row's
neighbours are the comparison. See docs/batch.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clef_api import credentials
from clef_api.workers_ai import PATH_TEMPLATE
from clef_protocol.arg_types import positive_int
from clef_tools.bench_body import generated_body
from clef_tools.bench_report import RunRow, plot_runs, summarise, write_report
from clef_tools.http_client import Endpoint, HttpConnection
from clef_tools.load import EXCHANGE_ERRORS, closed_loop
from clef_tools.progress import Progress

SYSTEMONE = "/v1/systemone"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-bench",
        description="Measure a running clef-serve: throughput and latency by concurrency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--requests", type=positive_int, required=True,
                        help="requests per concurrency level")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", required=True,
                        metavar="C", help="concurrency levels (clients), run in this order")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="where report.json and latency.png are written")
    body = parser.add_argument_group("requests")
    body.add_argument("--body", type=Path, default=None, metavar="FILE",
                      help="send this JSON body (instead of a generated one)")
    body.add_argument("--tokens", type=positive_int, default=400,
                      help="generated body: words in the state (about one token each)")
    body.add_argument("--questions", type=positive_int, default=3,
                      help="generated body: questions (noul, choice, score in turn)")
    body.add_argument("--model", default="clef-flash", help="the model field of generated bodies")
    body.add_argument("--workers-ai", action="store_true",
                      help=f"use the Workers-AI route ({PATH_TEMPLATE})")
    body.add_argument("--account-id", default="bench", help="the account in the Workers-AI path")
    body.add_argument("--model-name", default="clef-flash",
                      help="the model in the Workers-AI path (a --served-model-name)")
    body.add_argument("--api-key", default=os.environ.get(credentials.ENV_VAR), metavar="KEY",
                      help=f"sent as 'Authorization: Bearer KEY' (default: ${credentials.ENV_VAR}, "
                           "which keeps the key out of the process list)")
    body.add_argument("--same-body", action="store_true",
                      help="send the body byte for byte every time (by default each request "
                           f"gets its own top-level {SEQUENCE_FIELD!r} number, which Clef ignores, "
                           "so the server's answer cache cannot answer it)")
    parser.add_argument("--warmup", type=int, default=8,
                        help="requests sent before the first level, not counted")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one request may take (a slower one counts as an error)")
    parser.add_argument("--progress-interval", type=float, default=10.0,
                        help="seconds between progress lines when stderr is not a terminal")
    return parser


# A top-level field Clef ignores: one number per request makes every body distinct, so a load
# test measures forwards, not the server's answer cache (which answers identical repeats).
SEQUENCE_FIELD = "clef_bench_request"
Bodies = Callable[[int], bytes]


def body_factory(body: bytes, same_body: bool) -> Bodies:
    """Request number -> its body: `body` itself, or `body` with its own sequence number."""
    document = json.loads(body)
    if same_body or not isinstance(document, dict):
        return lambda _number: body
    return lambda number: json.dumps({**document, SEQUENCE_FIELD: number},
                                     separators=(",", ":")).encode()


async def _health(endpoint: Endpoint, timeout: float) -> Any:
    connection = HttpConnection(endpoint, timeout)
    try:
        answer = await connection.request("GET", "/health")
    finally:
        await connection.close()
    try:
        return json.loads(answer.body)
    except ValueError:
        raise ValueError(f"GET /health answered {answer.status} without JSON; is this "
                         "clef-serve?") from None


async def _level(endpoint: Endpoint, target: str, bodies: Bodies, first: int,
                 headers: tuple[tuple[str, str], ...], requests: int, concurrency: int,
                 timeout: float, progress: Progress | None) -> tuple[RunRow, Counter[str]]:
    """One closed-loop run: `concurrency` clients share `requests` requests, numbered from
    `first` (their bodies: `bodies(number)`)."""
    run = await closed_loop(endpoint, "POST", target, bodies, clients=concurrency,
                            requests=requests, first=first, headers=headers, timeout=timeout,
                            on_answer=progress.update if progress is not None else None)
    outcomes = Counter(sample.outcome for sample in run.samples)
    latencies = [sample.ms for sample in run.samples if sample.outcome == "200"]
    errors = sum(count for outcome, count in outcomes.items() if outcome != "200")
    return summarise(concurrency, latencies, errors, run.wall_s), outcomes


async def run(args: argparse.Namespace, body: bytes) -> int:
    endpoint = Endpoint.parse(args.url)
    target = (PATH_TEMPLATE.format(account_id=args.account_id, model=args.model_name)
              if args.workers_ai else SYSTEMONE)
    headers = (("Authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    server = await _health(endpoint, args.timeout)
    bodies = body_factory(body, args.same_body)
    sent = 0
    if args.warmup > 0:
        await _level(endpoint, target, bodies, sent, headers, args.warmup, 1, args.timeout, None)
        sent += args.warmup
    rows: list[RunRow] = []
    for concurrency in args.concurrency:
        progress = Progress(f"clef-bench C{concurrency}", args.requests,
                            interval=args.progress_interval)
        row, outcomes = await _level(endpoint, target, bodies, sent, headers, args.requests,
                                     concurrency, args.timeout, progress)
        sent += args.requests
        progress.close()
        rows.append(row)
        shown = ", ".join(f"{count} x {outcome}" for outcome, count in sorted(outcomes.items()))
        p50 = "-" if row.p50_ms is None else f"{row.p50_ms:.1f}"
        p99 = "-" if row.p99_ms is None else f"{row.p99_ms:.1f}"
        print(f"clef-bench: C{concurrency}: {row.throughput_rps:.1f} req/s, p50 {p50} ms, "
              f"p99 {p99} ms ({shown})", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "report.json"
    write_report(report, server, rows, target=target, body_bytes=len(body))
    print(f"clef-bench: wrote {report}", file=sys.stderr)
    try:
        plot_runs(args.out / "latency.png", rows,
                  f"clef-bench {args.url}{target}, {args.requests} requests per level")
    except ImportError:
        print("clef-bench: matplotlib is not installed (pip install 'clef-serve[plot]'): "
              "no latency.png", file=sys.stderr)
    else:
        print(f"clef-bench: wrote {args.out / 'latency.png'}", file=sys.stderr)
    return 1 if any(row.errors for row in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        Endpoint.parse(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    if args.body is not None:
        body = args.body.read_bytes()
        try:
            json.loads(body)
        except ValueError:
            parser.error(f"--body {args.body}: not a JSON document")
    else:
        body = generated_body(args.tokens, args.questions, args.model)
    try:
        return asyncio.run(run(args, body))
    except (ValueError, *EXCHANGE_ERRORS) as exc:
        print(f"clef-bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("clef-bench: interrupted; no report written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

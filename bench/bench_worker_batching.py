"""Worker throughput with and without micro-batching, measured side by side in one run.

Not a test. Starts `python -m clef_worker` directly (no HTTP front: this measures the worker's
batching alone) and writes request frames to its stdin, keeping C requests in flight: whenever a
reply comes back, the next request goes out, so the worker always finds up to C-1 frames waiting
when a forward ends. Rows, each with a fresh worker:

- C1: one request at a time (the baseline);
- C8 unbatched: 8 in flight, `--max-batch-tokens 1` (every forward holds one request);
- C8 batched: 8 in flight, the default token budget (by device: clef_worker.serving.batching);
- C8 batched, `--max-batch-tokens N`: the same with each budget given by `--budgets`, to choose
  a default by measurement.

All rows' workers run side by side: started together, then taking turns for `--rounds` rounds
(the median rate is reported, with its range), so other work on a shared host weighs on every
row alike. Every answer is compared with the C1 answer of the same request (golden tolerance).

    python bench/bench_worker_batching.py                      # tiny fixture, CPU
    python bench/bench_worker_batching.py --concurrency 1 4 16 32 --device cuda --model demo
    python bench/bench_worker_batching.py --quick              # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.bodies import request_bodies
from benchlib.paths import TINY_SNAPSHOT
from benchlib.worker_pipe import Worker, same_answer
from clef_protocol import messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--questions", type=int, choices=[1, 2, 3], default=3,
                        help="questions per request (1: a shorter request)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="turns each row takes (interleaved); the median is reported")
    parser.add_argument("--budgets", type=int, nargs="*", default=[],
                        help="extra batched rows, one per --max-batch-tokens value")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the worker (on a shared CPU host, 1 avoids "
                             "OpenMP spinning against other processes)")
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="extra worker flag (repeatable), e.g. --worker-flag=--dtype=bfloat16")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: 8 requests, C1 and C4, CPU, no output file")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.device, args.rounds = 8, [4], "cpu", 1
    flags = ["--model", args.model, "--device", args.device, "--max-length", "2048",
             *args.worker_flag]
    bodies = request_bodies(args.requests, args.questions)
    plans: list[tuple[str, int, list[str]]] = [("C1", 1, [])]
    for c in args.concurrency:
        if c > 1:
            plans += [(f"C{c} unbatched", c, ["--max-batch-tokens", "1"]), (f"C{c} batched", c, [])]
            plans += [(f"C{c} batched, --max-batch-tokens {n}", c, ["--max-batch-tokens", str(n)])
                      for n in args.budgets]
    # Every row's worker is started first; the rows then take turns, round after round, so a
    # burst of other work on a shared host falls on all of them alike (medians reported).
    workers = [Worker(flags + extra, args.threads) for _, _, extra in plans]
    for worker in workers:
        worker.run(bodies[:2], 1)  # untimed: first-touch costs
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in plans}
    all_ok = {name: True for name, _, _ in plans}
    equal = dict(all_ok)
    worker_ms: dict[str, list[float]] = {name: [] for name, _, _ in plans}
    baseline: dict[int, dict] = {}
    for _ in range(args.rounds):
        for (name, in_flight, _), worker in zip(plans, workers, strict=True):
            took, replies = worker.run(bodies, in_flight)
            seconds[name].append(took)
            worker_ms[name] += [r["worker_ms"] for r in replies.values()]
            ok = all(r["kind"] == messages.RESPONSE for r in replies.values())
            baseline = baseline or replies
            all_ok[name] &= ok
            equal[name] &= ok and all(same_answer(replies[i]["body"], baseline[i]["body"])
                                      for i in replies)
    for worker in workers:
        worker.close()
    rows: list[dict[str, Any]] = []
    for name, _, _ in plans:
        rates = sorted(len(bodies) / took for took in seconds[name])
        rows.append({"row": name, "requests": len(bodies), "rounds": args.rounds,
                     "req_per_s": round(statistics.median(rates), 2),
                     "req_per_s_range": [round(rates[0], 2), round(rates[-1], 2)],
                     "worker_ms_p50": round(statistics.median(worker_ms[name]), 2),
                     "all_ok": all_ok[name], "answers_equal_to_C1": equal[name]})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["req_per_s"]
    tokens = sorted(int(reply.get("input_tokens", 0)) for reply in baseline.values())
    summary = {"model": args.model, "device": args.device, "threads": args.threads,
               "questions": args.questions,
               "request_tokens": [tokens[0], tokens[len(tokens) // 2], tokens[-1]],
               "speedup_vs_C1": {row["row"]: round(row["req_per_s"] / base, 2) for row in rows}}
    print(json.dumps(summary))
    return 0 if all(row["all_ok"] and row["answers_equal_to_C1"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

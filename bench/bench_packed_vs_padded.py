"""Packed against padded batches: C8 worker throughput over distinct mixed-length requests,
side by side in one run.

Not a test. Starts `python -m clef_worker` directly (no HTTP front: this measures the worker's
batching alone, as bench_worker_batching.py does) and keeps C requests in flight over its pipe.
The requests are distinct (no cache can answer one for another) and their lengths spread from
the shortest a request can be on the tiny fixture (~130 tokens) to ~1,500, in an order that
puts far-apart lengths next to each other (benchlib.bodies.mixed_length_bodies): the mix where
padding every row to the group's longest wastes the most. Rows, each with its own worker:

- C1: one request at a time (the answers every other row is compared with);
- C8 padded: `--batch-layout padded` (rows right-padded to the group's longest; on CPU no
  length buckets);
- C8 packed: `--batch-layout packed` (the rows' tokens end to end with cumulative offsets).

Both C8 rows keep the default token budget for the device (4,096 on CPU: padded counts rows x
longest, packed counts real tokens). The rows take turns for `--rounds` rounds (median reported,
with its range), so other work on a shared host weighs on every row alike. Every answer is
compared with the C1 answer of the same request within the golden bound (1e-4); the script
exits non-zero when one differs or fails.

    python bench/bench_packed_vs_padded.py                # tiny fixture, CPU, 48 requests
    python bench/bench_packed_vs_padded.py --threads 1    # on a shared host
    python bench/bench_packed_vs_padded.py --quick        # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchlib.bodies import mixed_length_bodies
from benchlib.paths import TINY_SNAPSHOT
from benchlib.worker_pipe import Worker, same_answer
from clef_protocol import messages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--longest", type=int, default=1500,
                        help="about the longest request's tokens")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5,
                        help="turns each row takes (interleaved); the median is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for the workers")
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="extra worker flag for every row (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: 12 requests up to ~600 tokens, C4, one round")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.longest, args.concurrency, args.rounds = 12, 600, 4, 1
        args.device = "cpu"
    flags = ["--model", args.model, "--device", args.device, "--max-length", "2048",
             *args.worker_flag]
    bodies = mixed_length_bodies(args.requests, args.longest)
    c = args.concurrency
    plans: list[tuple[str, int, list[str]]] = [
        ("C1", 1, []),
        (f"C{c} padded", c, ["--batch-layout", "padded"]),
        (f"C{c} packed", c, ["--batch-layout", "packed"]),
    ]
    workers = [Worker(flags + extra, args.threads) for _, _, extra in plans]
    for worker in workers:
        worker.run(bodies[:2], 1)  # untimed: first-touch costs
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in plans}
    sizes: dict[str, list[int]] = {name: [] for name, _, _ in plans}
    ok = {name: True for name, _, _ in plans}
    equal = dict(ok)
    baseline: dict[int, dict] = {}
    for _ in range(args.rounds):
        for (name, in_flight, _), worker in zip(plans, workers, strict=True):
            took, replies = worker.run(bodies, in_flight)
            seconds[name].append(took)
            sizes[name] += [int(r.get("batch_size", 1)) for r in replies.values()]
            answered = all(r["kind"] == messages.RESPONSE for r in replies.values())
            baseline = baseline or replies
            ok[name] &= answered
            equal[name] &= answered and all(same_answer(replies[i]["body"], baseline[i]["body"])
                                            for i in replies)
    layouts = {name: worker.ready.get("batch_layout") for (name, _, _), worker
               in zip(plans, workers, strict=True)}
    for worker in workers:
        worker.close()
    rows: list[dict[str, Any]] = []
    for name, _, _ in plans:
        rates = sorted(len(bodies) / took for took in seconds[name])
        rows.append({"row": name, "layout": layouts[name], "requests": len(bodies),
                     "rounds": args.rounds, "req_per_s": round(statistics.median(rates), 2),
                     "req_per_s_range": [round(rates[0], 2), round(rates[-1], 2)],
                     "mean_batch_size": round(statistics.mean(sizes[name]), 2),
                     "all_ok": ok[name], "answers_equal_to_C1": equal[name]})
        print(json.dumps(rows[-1]), flush=True)
    tokens = sorted(int(reply.get("input_tokens", 0)) for reply in baseline.values())
    by_name = {row["row"]: row["req_per_s"] for row in rows}
    summary = {"model": args.model, "device": args.device, "threads": args.threads,
               "request_tokens": [tokens[0], tokens[len(tokens) // 2], tokens[-1]],
               "packed_vs_padded": round(by_name[f"C{c} packed"] / by_name[f"C{c} padded"], 2)}
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, **summary}, indent=1) + "\n")
    return 0 if all(row["all_ok"] and row["answers_equal_to_C1"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

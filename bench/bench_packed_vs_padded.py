"""Packed against padded batches, and the default layout against both: C8 worker throughput
over distinct requests of mixed lengths and of one length, side by side in one run.

Not a test. Starts `python -m clef_worker` directly (no HTTP front: this measures the worker's
batching alone, as bench_worker_batching.py does) and keeps C requests in flight over its pipe.
The requests are distinct (no cache can answer one for another). Two mixes:

- `mixed`: lengths spread from the shortest a request can be on the tiny fixture (~130 tokens)
  to ~1,500, in an order that puts far-apart lengths next to each other
  (benchlib.bodies.mixed_length_bodies): the mix where padding every row to the group's longest
  wastes the most;
- `uniform`: every request the same length (~500 tokens, benchlib.bodies.uniform_length_bodies):
  the mix where padding wastes nothing.

Rows, each with its own worker, the same workers for both mixes:

- C1: one request at a time (the answers every other row is compared with);
- C8 padded: `--batch-layout padded` (rows right-padded to the group's longest; on CPU no
  length buckets);
- C8 packed: `--batch-layout packed` (the rows' tokens end to end with cumulative offsets);
- C8 default: no `--batch-layout` (`auto`: on CPU each group padded or packed by how much
  padding it would waste, clef_worker.serving.policy.group_layout).

Every C8 row keeps the default token budget for the device (4,096 on CPU: padded counts rows x
longest, packed counts real tokens). The rows take turns for `--rounds` rounds, mix by mix,
in an order that rotates every round (median reported, with its range), so other work on a
shared host weighs on every row alike;
the summary gives the default's ratio to padded from the medians and from each row's best
round (`default_vs_padded_best`: on a loaded host, the least disturbed turns).
Every answer is compared with the C1 answer of the same request within the golden bound
(1e-4); the script exits non-zero when one differs or fails.

    python bench/bench_packed_vs_padded.py                # tiny fixture, CPU, both mixes
    python bench/bench_packed_vs_padded.py --threads 1    # on a shared host
    python bench/bench_packed_vs_padded.py --mix uniform  # one mix
    # rounds of ~3 s instead of ~0.7 s: the uniform ratio (1.0 by construction) within a few %
    python bench/bench_packed_vs_padded.py --threads 1 --mix uniform --requests 192
    python bench/bench_packed_vs_padded.py --quick        # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.bodies import mixed_length_bodies, uniform_length_bodies
from benchlib.paths import REPO, TINY_SNAPSHOT
from benchlib.provenance import command_line, cpu_line
from benchlib.worker_pipe import Worker, same_answer
from clef_frontend.build_info import git_commit
from clef_protocol import messages

MIXES = ("mixed", "uniform")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--longest", type=int, default=1500,
                        help="about the longest request's tokens (mixed)")
    parser.add_argument("--uniform-tokens", type=int, default=500,
                        help="about every request's tokens (uniform)")
    parser.add_argument("--mix", choices=(*MIXES, "both"), default="both")
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
    mixes = MIXES if args.mix == "both" else (args.mix,)
    bodies = {"mixed": mixed_length_bodies(args.requests, args.longest),
              "uniform": uniform_length_bodies(args.requests, args.uniform_tokens)}
    c = args.concurrency
    plans: list[tuple[str, int, list[str]]] = [
        ("C1", 1, []),
        (f"C{c} padded", c, ["--batch-layout", "padded"]),
        (f"C{c} packed", c, ["--batch-layout", "packed"]),
        (f"C{c} default", c, []),
    ]
    workers = [Worker(flags + extra, args.threads) for _, _, extra in plans]
    for worker in workers:
        worker.run(bodies[mixes[0]][:2], 1)  # untimed: first-touch costs
    layouts = {name: worker.ready.get("batch_layout") for (name, _, _), worker
               in zip(plans, workers, strict=True)}
    results = {mix: measure(plans, workers, bodies[mix], args.rounds) for mix in mixes}
    for worker in workers:
        worker.close()
    # What was measured: the command, the code (HEAD, +dirty) and the host beside the figures.
    report: dict[str, Any] = {"command": command_line(__file__),
                              "commit": git_commit(REPO) or "unknown", "host": cpu_line(),
                              "model": args.model, "device": args.device,
                              "threads": args.threads, "mixes": {}}
    ok = True
    for mix, (rows, tokens) in results.items():
        for row in rows:
            row["layout"] = layouts[row["row"]]
            print(json.dumps({"mix": mix, **row}), flush=True)
            ok &= row["all_ok"] and row["answers_equal_to_C1"]
        rate = {row["row"]: row["req_per_s"] for row in rows}
        best = {row["row"]: row["req_per_s_range"][1] for row in rows}
        summary = {"mix": mix, "request_tokens": [tokens[0], tokens[len(tokens) // 2],
                                                  tokens[-1]],
                   "packed_vs_padded": round(rate[f"C{c} packed"] / rate[f"C{c} padded"], 2),
                   "default_vs_padded": round(rate[f"C{c} default"] / rate[f"C{c} padded"], 2),
                   # The best rounds: on a loaded host the least disturbed turn of each row.
                   "default_vs_padded_best": round(best[f"C{c} default"] / best[f"C{c} padded"],
                                                   2)}
        print(json.dumps(summary), flush=True)
        report["mixes"][mix] = {"rows": rows, **summary}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


def measure(plans: list[tuple[str, int, list[str]]], workers: list[Worker], bodies: list[bytes],
            rounds: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Every row over these bodies, `rounds` interleaved turns: the rows, and the requests'
    token counts (sorted)."""
    seconds: dict[str, list[float]] = {name: [] for name, _, _ in plans}
    sizes: dict[str, list[int]] = {name: [] for name, _, _ in plans}
    ok = {name: True for name, _, _ in plans}
    equal = dict(ok)
    baseline: dict[int, dict] = {}
    turns = list(zip(plans, workers, strict=True))
    for round_ in range(rounds):
        # C1 first in the first round (its answers are the baseline); after that the order
        # rotates, so no row always follows the same one on a host whose load drifts.
        shift = round_ % len(turns)
        for (name, in_flight, _), worker in turns[shift:] + turns[:shift]:
            took, replies = worker.run(bodies, in_flight)
            seconds[name].append(took)
            sizes[name] += [int(r.get("batch_size", 1)) for r in replies.values()]
            answered = all(r["kind"] == messages.RESPONSE for r in replies.values())
            baseline = baseline or replies
            ok[name] &= answered
            equal[name] &= answered and all(same_answer(replies[i]["body"], baseline[i]["body"])
                                            for i in replies)
    rows: list[dict[str, Any]] = []
    for name, _, _ in plans:
        rates = sorted(len(bodies) / took for took in seconds[name])
        rows.append({"row": name, "requests": len(bodies), "rounds": rounds,
                     "req_per_s": round(statistics.median(rates), 2),
                     "req_per_s_range": [round(rates[0], 2), round(rates[-1], 2)],
                     "mean_batch_size": round(statistics.mean(sizes[name]), 2),
                     "all_ok": ok[name], "answers_equal_to_C1": equal[name]})
    tokens = sorted(int(reply.get("input_tokens", 0)) for reply in baseline.values())
    return rows, tokens


if __name__ == "__main__":
    sys.exit(main())

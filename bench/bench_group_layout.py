"""Where padded overtakes packed on CPU: one group's forward, packed and padded, as its lengths
spread (the measurement behind clef_worker.serving.policy.MAX_PADDED_WASTE).

Not a test. In one process, two executors over the same snapshot (`--batch-layout packed`,
`--batch-layout padded`, no graphs), and for each longest length and spread a group of
`--rows` requests: the longest, the others drawn (seeded) between `longest x (1 - spread)` and
`longest`. Each group runs through both runners in turn, `--repeats` times; the fastest run of
each is kept (on a shared host the least disturbed one). A row per group: its padding waste
(the share of rows x longest that is pad), both times, and padded's speed over packed.

    python bench/bench_group_layout.py                    # tiny fixture, 1 thread
    python bench/bench_group_layout.py --threads 2 --longest 300,600,1000
    python bench/bench_group_layout.py --quick            # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.paths import TINY_SNAPSHOT
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.encoding import Encoding
from clef_worker.serving.policy import padding_waste
from clef_worker.serving.runner import ModelRunner

SPREADS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.6)
# A state far longer than any group needs; the encoder cuts it to each request's length.
REQUEST: dict[str, Any] = {
    "model": "clef-flash",
    "state": "".join(f"Ticket 7000-{k}: customer paid invoice #{k} twice. " for k in range(400)),
    "questions": {"refund": {"type": "noul", "criteria": {"true": None, "false": None}}},
}
SHORTEST = 140  # above the ~126 tokens of the schema alone


def timed(runner: ModelRunner, encodings: list[Encoding]) -> float:
    started = time.perf_counter()
    runner.run(encodings)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--longest", default="300,600,1000",
                        help="comma-separated longest lengths, in tokens")
    parser.add_argument("--rows", type=int, default=8, help="requests per group")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: one longest length, groups of 4, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.longest, args.rows, args.repeats = "300", 4, 1
    torch.set_num_threads(args.threads)
    limits = RequestLimits(max_length=4096)
    packed = assemble_snapshot(args.model, device="cpu", batch_layout="packed", limits=limits,
                               media="off")
    padded = assemble_snapshot(args.model, device="cpu", batch_layout="padded", limits=limits,
                               media="off")
    for longest in (int(text) for text in args.longest.split(",")):
        for spread in SPREADS:
            draw = random.Random(longest)
            targets = [longest] + [max(SHORTEST, int(longest * (1 - spread * draw.random())))
                                   for _ in range(args.rows - 1)]
            encodings = [packed.encoder.encode(REQUEST, target) for target in targets]
            lengths = [encoding.length for encoding in encodings]
            best = {"packed": float("inf"), "padded": float("inf")}
            for turn in range(args.repeats + 1):  # the first turn is untimed: first touches
                for name, executor in (("packed", packed), ("padded", padded)):
                    took = timed(executor.runner, encodings)
                    if turn:
                        best[name] = min(best[name], took)
            print(json.dumps({
                "threads": args.threads, "longest": longest, "spread": spread,
                "waste": round(padding_waste(lengths), 3),
                "packed_ms": round(best["packed"] * 1000, 1),
                "padded_ms": round(best["padded"] * 1000, 1),
                "padded_speed_over_packed": round(best["packed"] / best["padded"], 2)}),
                flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of a packed forward is padding, for realistic length mixes: the chunk-aligned rows
and token-spaced buckets the packed graphs had, against the dense rows and cost-spaced buckets
they have now (clef_worker.serving.gpu.packed_graphs, clef_worker.serving.gpu.buckets).

Not a test, and no forward runs: the figures follow from the bucket tables and the row layouts
alone. For each group: its real tokens, the tokens its row needs (`aligned_total`), the bucket
that holds them, the share of the bucket that is padding, and the modelled replay time spent
on it, `(fixed + bucket) / (fixed + real) - 1` with the fixed part in token times (413: the
H200's fit, 9.5 ms fixed and 23 us a token, 2026-12-04; not modelled: the dense row's up to
one extra Gated DeltaNet chunk per request). Mixes: `c393`, groups of 1 to 16
requests of 385-401 tokens (the C16 phase of the first H200 sitting); `mixed`, groups of 1 to
16 lengths drawn log-normally around 400 (90 to 2,000) up to the token budget; `single`, one
request at every 97th length up to the budget.

    python bench/bench_packed_padding.py           # writes bench/results/cpu-packed-padding.json
    python bench/bench_packed_padding.py --quick   # CI smoke run (fewer groups, no file)
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.provenance import command_line
from clef_worker.model.packed import FLA_CHUNK
from clef_worker.serving.gpu.buckets import (
    DEFAULT_FIXED_TOKENS,
    bucket_lengths,
    cost_bucket_lengths,
)
from clef_worker.serving.gpu.packed_graphs import aligned_total

BUDGET = 16384  # the H200 defaults: --max-batch-tokens and --max-length
MAX_SEQUENCES = 16
RESULT = Path(__file__).resolve().parent / "results" / "cpu-packed-padding.json"


def mixes(groups: int, seed: int = 0) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    out: list[tuple[str, list[int]]] = []
    for n in range(1, MAX_SEQUENCES + 1):
        out.append(("c393", [393 + rng.randint(-8, 8) for _ in range(n)]))
    for _ in range(groups):
        lengths = [min(2000, max(90, int(rng.lognormvariate(5.99, 0.6))))
                   for _ in range(rng.randint(1, MAX_SEQUENCES))]
        while aligned_total(lengths, FLA_CHUNK) > BUDGET:
            lengths.pop()
        out.append(("mixed", lengths))
    out += [("single", [length]) for length in range(100, BUDGET + 1, 97)]
    return out


def layouts() -> dict[str, tuple[tuple[int, ...], int]]:
    """(buckets, row alignment) of each layout compared."""
    return {
        "chunk_aligned_token_table": (bucket_lengths(BUDGET, step=FLA_CHUNK), FLA_CHUNK),
        "dense_token_table": (bucket_lengths(BUDGET, step=FLA_CHUNK), 1),
        "chunk_aligned_cost_table": (cost_bucket_lengths(BUDGET, step=FLA_CHUNK), FLA_CHUNK),
        "dense_cost_table": (cost_bucket_lengths(BUDGET, step=FLA_CHUNK), 1),
    }


def measure(groups: list[tuple[str, list[int]]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    fixed = DEFAULT_FIXED_TOKENS
    for name, (buckets, align) in layouts().items():
        by_kind: dict[str, dict[str, float]] = {}
        for kind, lengths in groups:
            real = sum(lengths)
            bucket = buckets[bisect.bisect_left(buckets, aligned_total(lengths, align))]
            entry = by_kind.setdefault(kind, {"groups": 0, "real": 0, "run": 0, "time": 0.0})
            entry["groups"] += 1
            entry["real"] += real
            entry["run"] += bucket
            entry["time"] += (fixed + bucket) / (fixed + real) - 1
        rows[name] = {"shapes": len(buckets), **{
            kind: {"padding_share_of_tokens_run": round(1 - e["real"] / e["run"], 4),
                   "mean_modelled_time_overhead": round(e["time"] / e["groups"], 4),
                   "groups": int(e["groups"])}
            for kind, e in by_kind.items()}}
    c16 = next(lengths for kind, lengths in groups if kind == "c393" and len(lengths) == 16)
    for name, (buckets, align) in layouts().items():
        need = aligned_total(c16, align)
        rows[name]["c16_example"] = {"real": sum(c16), "row": need,
                                     "bucket": buckets[bisect.bisect_left(buckets, need)]}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2000, help="random mixed groups")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 50 groups, no file")
    args = parser.parse_args(argv)
    rows = measure(mixes(50 if args.quick else args.groups))
    for name, row in rows.items():
        cells = " ".join(f"{kind} {row[kind]['padding_share_of_tokens_run']:.1%}/"
                         f"{row[kind]['mean_modelled_time_overhead']:.1%}"
                         for kind in ("c393", "mixed", "single"))
        print(f"{name:26s} {row['shapes']:2d} shapes  padding tokens/time: {cells}  "
              f"C16: {row['c16_example']}")
    if args.quick:
        before, after = rows["chunk_aligned_token_table"], rows["dense_cost_table"]
        share = "padding_share_of_tokens_run"
        less = all(after[k][share] < before[k][share] for k in ("c393", "mixed", "single"))
        return 0 if less else 1
    result = {"command": command_line("bench/bench_packed_padding.py",
                                      sys.argv[1:] if argv is None else argv),
              "budget": BUDGET, "fixed_tokens": DEFAULT_FIXED_TOKENS, "layouts": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

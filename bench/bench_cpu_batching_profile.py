"""Where a request's time goes on CPU, alone and in a batch of eight: what batching can gain.

Not a test. Loads the native executor in this process (no worker, no pipe; the worker's
allocator settings applied) and prints markdown:

1. the stages of one request alone (parse + validate + tokenise, backbone, head, serialise);
2. the backbone's cost by batch rows B and row length T, with its fixed part (a 16-token
   forward: Python, dispatch, allocation, the per-layer loops) and the size of one chunked
   Gated DeltaNet intermediate ([B, value heads, chunks, C, C] float32 with the chunk size C
   clef_worker.model.gated_delta picks for B rows, several per layer), set against the L2 cache;
3. the head alone and over a batch of eight records (one `forward_batch` pass);
4. the torch ops that cost most per request, alone and at B=8 (torch.profiler);
5. whole `answer_prepared` calls alone and on eight requests (median ms per request; with
   `--glibc-defaults` the allocator's thresholds stay glibc's, to see what the worker's
   clef_worker.allocator settings save);
6. C8 / C1 from the measured stages: a request alone costs prepare + backbone at B=1 + head +
   serialise, one in a batch of eight prepare + serialise + the backbone and head per row at
   B=8. (The profiler's per-op times carry its own overhead per op, so they show where the
   time goes, not a floor.)

    python bench/bench_cpu_batching_profile.py --threads 1     # tiny fixture
    python bench/bench_cpu_batching_profile.py --quick         # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.bodies import request_bodies
from benchlib.paths import TINY_SNAPSHOT
from benchlib.timing import best_ms, median_ms
from clef_worker.allocator import keep_freed_memory
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.answers import build_response, serialize
from clef_worker.model.gated_delta import chunk_size_for
from clef_worker.model.head_batch import HeadBatch, RecordSpans
from clef_worker.native import NativeExecutor


def l2_bytes() -> int | None:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
    except OSError:
        return None
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def stage_table(executor: NativeExecutor,
                bodies: list[bytes]) -> tuple[dict[str, float], str]:
    """Median stage times of requests answered alone; returns (medians, table)."""
    rows: dict[str, list[float]] = {"prepare": [], "backbone": [], "head": [], "serialise": [],
                                    "total": []}
    for body in bodies:
        started = time.perf_counter()
        prepared = executor.prepare(body)
        prepare_ms = (time.perf_counter() - started) * 1000
        output = executor.runner.run([prepared.encoding])
        probabilities = output.rows[0].probabilities
        timings = {"backbone": output.stages["forward_ms"], "head": output.stages["head_ms"]}
        started = time.perf_counter()
        serialize(build_response(prepared.request, prepared.encoding, probabilities))
        serialise_ms = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        executor.answer_prepared([executor.prepare(body)])
        rows["total"].append((time.perf_counter() - started) * 1000)
        rows["prepare"].append(prepare_ms)
        rows["backbone"].append(timings["backbone"])
        rows["head"].append(timings["head"])
        rows["serialise"].append(serialise_ms)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    table = ["| stage | ms (median) | share of total |", "|---|---:|---:|"]
    table += [f"| {name} | {value:.2f} | {value / medians['total']:.0%} |"
              for name, value in medians.items()]
    return medians, "\n".join(table)


def backbone_table(executor: NativeExecutor, length: int, batches: list[int],
                   repeats: int) -> tuple[dict[int, float], str]:
    """Backbone time by (B, T); returns (best ms per row by B, T=16 under key 0; table)."""
    model = executor.backbone.model
    heads = int(model.config.linear_num_value_heads)
    cache = l2_bytes()
    table = ["| B | T | ms per forward (best) | ms per row | one GDN chunk intermediate |",
             "|---:|---:|---:|---:|---:|"]
    per_row: dict[int, float] = {}
    with torch.inference_mode():
        for rows, tokens in [(1, 16), *((b, length) for b in batches)]:
            ids = torch.randint(0, 500, (rows, tokens))
            def step(ids: torch.Tensor = ids) -> object:
                return model(input_ids=ids, use_cache=False)
            ms = best_ms(step, repeats)
            per_row[0 if tokens == 16 else rows] = ms / rows
            chunk = chunk_size_for(rows)
            size = rows * heads * -(-tokens // chunk) * chunk * chunk * 4
            note = f"{size / 2**20:.2f} MiB" + (
                f" ({size / cache:.1f} x L2)" if cache else "")
            table.append(f"| {rows} | {tokens} | {ms:.2f} | {ms / rows:.2f} | {note} |")
    return per_row, "\n".join(table)


def head_table(executor: NativeExecutor, bodies: list[bytes], repeats: int,
               rows: int = 8) -> tuple[dict[int, float], str]:
    """The head per record alone and in one pass over `rows` records (best of `repeats`)."""
    encodings = [executor.prepare(body).encoding for body in bodies[:rows]]
    hidden_size = executor.backbone.hidden_size
    records = [RecordSpans(len(e.input_ids), [q.question_span for q in e.questions],
                           [q.option_spans for q in e.questions],
                           [q.type_id for q in e.questions]) for e in encodings]
    per_row: dict[int, float] = {}
    table = ["| records in the pass | ms per pass (best) | ms per record |", "|---:|---:|---:|"]
    with torch.inference_mode():
        for count in (1, rows):
            batch = HeadBatch.build(records[:count])
            tokens = sum(r.tokens for r in records[:count])
            hidden = torch.randn(tokens, hidden_size)
            ids = torch.cat([torch.tensor(e.input_ids) for e in encodings[:count]])
            def step(hidden: torch.Tensor = hidden, ids: torch.Tensor = ids,
                     batch: HeadBatch = batch) -> object:
                return executor.head.forward_batch(hidden, ids, executor.backbone.lexical_table,
                                                   batch)
            ms = best_ms(step, repeats)
            per_row[count] = ms / count
            table.append(f"| {count} | {ms:.2f} | {ms / count:.2f} |")
    return per_row, "\n".join(table)


def op_table(executor: NativeExecutor, length: int, batches: list[int], top: int) -> str:
    """The costliest torch ops, in ms per row, for each batch size (a markdown table)."""
    model = executor.backbone.model
    per_batch: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in batches:
            ids = torch.randint(0, 500, (rows, length))
            for _ in range(2):  # the first profiled run pays the profiler's own set-up
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    model(input_ids=ids, use_cache=False)
            per_batch[rows] = {event.key: event.self_cpu_time_total / 1000 / rows
                               for event in prof.key_averages()}
    first = per_batch[batches[0]]
    names = sorted(first, key=first.__getitem__, reverse=True)[:top]
    header = "| op (self CPU, ms per row) | " + " | ".join(f"B={b}" for b in batches) + " |"
    table = [header, "|---|" + "---:|" * len(batches)]
    for name in names:
        table.append(f"| `{name}` | " + " | ".join(
            f"{per_batch[b].get(name, 0.0):.2f}" for b in batches) + " |")
    totals = {b: sum(per_batch[b].values()) for b in batches}
    table.append("| all ops | " + " | ".join(f"{totals[b]:.2f}" for b in batches) + " |")
    return "\n".join(table)


def answered_ms(executor: NativeExecutor, bodies: list[bytes], rows: int,
                repeats: int) -> float:
    """Median ms per request of whole `answer_prepared` calls on `rows` requests: the median,
    not the best, so that costs paid on most calls (page faults, allocation) show."""
    prepared = [executor.prepare(body) for body in bodies[:rows]]
    if len(prepared) != rows:
        raise SystemExit(f"--requests must be at least {rows}")
    return median_ms(lambda: executor.answer_prepared(prepared), repeats) / rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's allocator thresholds alone (the worker raises them)")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: few repeats")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 8, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.glibc_defaults:
        keep_freed_memory()  # as the worker does
    executor = assemble_snapshot(args.model, device="cpu")
    executor.warm_up()
    bodies = request_bodies(args.requests)
    lengths = [executor.prepared_length(executor.prepare(body)) for body in bodies]
    length = int(statistics.median(lengths))
    # First, while the allocator has seen only the warm-up: what a worker's forwards meet.
    answered = {rows: answered_ms(executor, bodies, rows, args.repeats) for rows in (1, 8)}
    batches = [1, 2, 8] if args.quick else [1, 2, 4, 8]
    stage_ms, stages = stage_table(executor, bodies)
    per_row, backbone = backbone_table(executor, length, batches, args.repeats)
    head_ms, heads = head_table(executor, bodies, args.repeats)
    ops = op_table(executor, length, [1, 8], 10)
    outside = stage_ms["prepare"] + stage_ms["serialise"]
    alone = outside + per_row[1] + head_ms[1]
    batched = outside + per_row[8] + head_ms[8]
    allocator = "glibc defaults" if args.glibc_defaults else "the worker's allocator thresholds"
    print(f"torch threads {torch.get_num_threads()}, {allocator}; requests of "
          f"{min(lengths)}-{max(lengths)} tokens (median {length})\n")
    print("Stages of one request alone:\n\n" + stages + "\n")
    print("Backbone by batch rows B and row length T (T=16: the fixed part of a forward):\n\n"
          + backbone + "\n")
    print("Head alone and over a batch of eight records:\n\n" + heads + "\n")
    print("Costliest backbone ops, self CPU time per row:\n\n" + ops + "\n")
    print(f"Whole answer_prepared calls, median ms per request: alone {answered[1]:.2f}, "
          f"in a batch of eight {answered[8]:.2f}\n")
    print(json.dumps({"alone_ms": round(alone, 2), "fixed_backbone_ms": round(per_row[0], 2),
                      "batched_ms": round(batched, 2), "c8_speedup_stages": round(
                          alone / batched, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

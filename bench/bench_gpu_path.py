"""The GPU path of issues 11 and 12 at Clef-Flash's real shapes: eager vs CUDA graphs, and
batching, with random weights built in memory (bench/bench_flash_shaped.py builds the model).

Not a test. For each mode (`--modes eager graphs`) it builds the executor, times warm-up (which
captures every bucket up to --max-length in graphs mode), reports graph memory, then:
- latency by length: p50/p99/min of `answer` at 150 / 370 / 1,000 / 2,000 / 7,000 / 16,000
  tokens (3 questions);
- fresh lengths: after warm-up, the first request at lengths never seen before, against the
  warm p50 of its bucket (the target is <= 1.5x);
- batching: requests/s answering C requests per forward (`answer_prepared`, what the worker does
  with C frames waiting) against the same C requests one by one, at each `--concurrency`;
- graphs vs eager answers on the same requests (every argmax equal, max |dprob|).

    python bench/bench_gpu_path.py --device cuda --gdn-prefill fla --out results.json
    python bench/bench_gpu_path.py --quick          # CPU smoke run, small shapes, no file
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from typing import Any

from bench_flash_shaped import (
    add_mode_arguments,
    add_shape_arguments,
    apply_quick,
    build_for_modes,
    make_request,
    save,
)

log = logging.getLogger("bench_gpu_path")

LENGTHS = [150, 370, 1000, 2000, 7000, 16000]


def timed(executor: Any, body: bytes) -> float:
    started = time.perf_counter()
    executor.answer(body)  # ends with a device-to-host copy: synchronised
    return (time.perf_counter() - started) * 1000


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered), 2),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
            "min_ms": round(ordered[0], 2), "n": len(ordered)}


def with_runner(executor: Any, mode: str, max_length: int) -> Any:
    """The in-memory executor with the bucket runner `--cuda-graphs on|off` would give it."""
    from clef_worker.gpu.buckets import BucketTable
    from clef_worker.gpu.graphs import BucketedBackbone, CudaGraphCapturer, EagerCapturer
    from clef_worker.native import NativeExecutor

    runner = None
    if mode == "graphs":
        capture = executor.device.type == "cuda"
        capturer = CudaGraphCapturer(executor.device) if capture else EagerCapturer()
        runner = BucketedBackbone(executor.backbone, BucketTable.for_budget(max_length),
                                  executor.pad_id, capturer, graphs=capture)
    return NativeExecutor(snapshot=executor.snapshot, encoder=executor.encoder,
                          backbone=executor.backbone, head=executor.head,
                          limits=executor.limits, runner=runner,
                          short_conv=executor.short_conv)


def measure(executor: Any, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = time.perf_counter()
    executor.warm_up()
    out["warmup_ms"] = round((time.perf_counter() - started) * 1000, 1)
    out["info"] = {k: v for k, v in executor.describe().__dict__.items()
                   if k in ("cuda_graphs", "buckets_captured", "graph_memory_bytes", "gdn_path",
                            "short_conv")}
    latency: dict[str, Any] = {}
    bodies: dict[int, bytes] = {}
    for tokens in args.lengths:
        if tokens > args.max_length:
            continue
        request = make_request(executor, tokens, 3)
        bodies[tokens] = json.dumps(request).encode()
        for _ in range(2):
            timed(executor, bodies[tokens])
        repeat = args.repeat if tokens <= 2000 else max(3, args.repeat // 4)
        latency[str(tokens)] = {"input_tokens": len(executor.encode(request).input_ids),
                                **summary([timed(executor, bodies[tokens])
                                           for _ in range(repeat)])}
        log.info("%s tokens: %s", tokens, latency[str(tokens)])
    out["latency"] = latency
    # fresh lengths: never seen before, each compared with its bucket's warm p50
    rng = random.Random(0)
    base = make_request(executor, 150, 3)
    fresh = []
    for _ in range(args.fresh):
        extra = rng.randrange(1, min(args.max_length, 4000) // 8)
        request = {**base, "state": base["state"] + " word" * extra}
        body = json.dumps(request).encode()
        first = timed(executor, body)
        warm = statistics.median(timed(executor, body) for _ in range(3))
        fresh.append({"tokens": len(executor.encode(request).input_ids),
                      "first_ms": round(first, 2), "warm_ms": round(warm, 2),
                      "ratio": round(first / warm, 2)})
    out["fresh_lengths"] = fresh
    out["fresh_worst_ratio"] = max((f["ratio"] for f in fresh), default=None)
    # batching: C requests per forward vs one by one
    throughput: dict[str, Any] = {}
    pool = [make_request(executor, 300 + 20 * (i % 8), 3) for i in range(8)]
    for c in args.concurrency:
        prepared = [executor.prepare(json.dumps(pool[i % len(pool)]).encode()) for i in range(c)]
        executor.answer_prepared(prepared)
        rounds = max(2, args.repeat // max(1, c // 2))
        started = time.perf_counter()
        for _ in range(rounds):
            executor.answer_prepared(prepared)
        batched = rounds * c / (time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(max(1, rounds // 2)):
            for item in prepared:
                executor.answer_prepared([item])
        solo = max(1, rounds // 2) * c / (time.perf_counter() - started)
        throughput[f"C{c}"] = {"batched_req_per_s": round(batched, 1),
                               "one_by_one_req_per_s": round(solo, 1)}
        log.info("C%d: %s", c, throughput[f"C{c}"])
    out["throughput"] = throughput
    out["answers"] = {str(t): executor.score(json.loads(b)).probabilities
                      for t, b in bodies.items()}
    return out


def compare(eager: dict[str, Any], graphs: dict[str, Any]) -> dict[str, Any]:
    worst = 0.0
    argmax_equal = True
    for key, probabilities in eager["answers"].items():
        other = graphs["answers"][key]
        worst = max(worst, *(abs(a - b) for a, b in zip(probabilities, other, strict=True)))
        argmax_equal &= probabilities.index(max(probabilities)) == other.index(max(other))
    return {"max_abs_probability_diff": worst, "argmax_equal": argmax_equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    add_mode_arguments(parser, ["eager", "graphs"])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--fresh", type=int, default=12)
    args = parser.parse_args()
    if args.quick:
        apply_quick(args)
        args.lengths, args.concurrency, args.repeat, args.fresh = [150, 370], [1, 4], 2, 2
    base, _, results = build_for_modes(args)
    for mode in args.modes:
        results["modes"][mode] = measure(with_runner(base, mode, args.max_length), args)
        save(args, results)
    if {"eager", "graphs"} <= set(results["modes"]):
        results["graphs_vs_eager"] = compare(results["modes"]["eager"],
                                             results["modes"]["graphs"])
    for mode in results["modes"].values():
        mode.pop("answers", None)
    save(args, results)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

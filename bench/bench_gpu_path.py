"""The GPU path at Clef-Flash's real shapes inside one process: eager vs CUDA graphs, and
batching, with random weights built in memory (benchlib/flash_model.py) and served by the
worker's own executor.

Not a test. For each mode (`--modes graphs eager`, in that order: the first pays the cold kernel
compilation, so graphs' warm-up is the cold figure) it loads the executor, times warm-up
(which captures every bucket up to --max-length in graphs mode), checks that every bucket was
captured (exit 1 otherwise: eager numbers must not pass as graphs), reports graph memory, then:
- latency by length: p50/p99/min of `answer` at 150 / 370 / 1,000 / 2,000 / 7,000 / 16,000
  tokens (3 questions);
- fresh lengths: after warm-up, the first request at lengths between 1,100 and 8,000 tokens
  never seen before, against the warm p50 of the same request (the target is <= 1.5x);
- batching: requests/s answering C requests per forward (`answer_prepared`, what the worker does
  with C frames waiting) against the same C requests one by one, at each `--concurrency`;
- graphs vs eager answers on the same requests, question by question (every argmax equal,
  max |dprob|, the top-2 margins where an argmax differs).

    python bench/bench_gpu_path.py --device cuda --gdn-prefill fla --out results.json
    python bench/bench_gpu_path.py --quick          # CPU smoke run, small shapes, no file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import (
    InMemoryModel,
    add_mode_arguments,
    add_shape_arguments,
    apply_quick,
    executor_for_mode,
    make_request,
)
from benchlib.gpu_checks import (
    capture_problems,
    capture_report,
    compare_questions,
    split_by_question,
)
from benchlib.provenance import command_line
from benchlib.timing import elapsed_ms, latency_summary, percentile, timed_ms

log = logging.getLogger("bench_gpu_path")

LENGTHS = [150, 370, 1000, 2000, 7000, 16000]
FRESH_RANGE = (1100, 8000)


def answer_ms(executor: Any, body: bytes) -> float:
    """One request's wall time; `answer` ends with a device-to-host copy, so it is synchronised."""
    return timed_ms(lambda: executor.answer(body))


def measure(executor: Any, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    started = time.perf_counter()
    executor.warm_up()
    out["warmup_ms"] = round(elapsed_ms(started), 1)
    info = dataclasses.asdict(executor.describe())
    out["info"] = {k: info.get(k) for k in ("gdn_path", "short_conv", "dtype")}
    out["capture"] = capture_report(info)
    out["capture_problems"] = capture_problems(info, graphs_requested=mode == "graphs",
                                               on_cuda=executor.device.type == "cuda")
    if out["capture_problems"]:
        return out
    latency: dict[str, Any] = {}
    requests: dict[str, dict[str, Any]] = {}
    for tokens in args.lengths:
        if tokens > args.max_length:
            continue
        request = make_request(executor, tokens, 3)
        requests[str(tokens)] = request
        body = json.dumps(request).encode()
        for _ in range(2):
            executor.answer(body)
        repeat = args.repeat if tokens <= 2000 else max(3, args.repeat // 4)
        latency[str(tokens)] = {"input_tokens": len(executor.encode(request).input_ids),
                                **latency_summary([answer_ms(executor, body)
                                                   for _ in range(repeat)])}
        log.info("%s %s tokens: %s", mode, tokens, latency[str(tokens)])
    out["latency"] = latency
    out["fresh_lengths"] = fresh_lengths(executor, args)
    out["fresh_max_ratio"] = max((f["ratio"] for f in out["fresh_lengths"]), default=None)
    out["throughput"] = batching(executor, args)
    answers = {}
    for key, request in requests.items():
        scored = executor.score(request)
        answers[key] = split_by_question(scored.probabilities,
                                         [len(q.option_ids) for q in scored.encoding.questions])
    out["answers"] = answers
    return out


def fresh_lengths(executor: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(0)
    low, high = args.fresh_range
    high = min(high, args.max_length)
    out = []
    for target in sorted(rng.sample(range(low, high), min(args.fresh, max(0, high - low)))):
        request = make_request(executor, target, 3)
        request["state"] = f"case {target}: " + request["state"]
        body = json.dumps(request).encode()
        first = answer_ms(executor, body)
        warm = percentile([answer_ms(executor, body) for _ in range(3)], 0.5)
        out.append({"tokens": len(executor.encode(request).input_ids),
                    "first_ms": round(first, 2), "warm_ms": round(warm, 2),
                    "ratio": round(first / warm, 2)})
    return out


def batching(executor: Any, args: argparse.Namespace) -> dict[str, Any]:
    """C requests per forward vs the same C one by one."""
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
    return throughput


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the results so far to `--out` (after each mode: a step cut short keeps them)."""
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    add_mode_arguments(parser, ["graphs", "eager"])
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--fresh", type=int, default=12)
    args = parser.parse_args(argv)
    args.fresh_range = FRESH_RANGE
    if args.quick:
        apply_quick(args)
        args.lengths, args.concurrency, args.repeat, args.fresh = [150, 370], [1, 4], 2, 2
        args.fresh_range = (380, 500)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    model = InMemoryModel(args.shape, args.layers)
    results: dict[str, Any] = {"command": command_line(__file__), "modes": {}}
    problems: list[str] = []
    for mode in args.modes:
        measured = measure(executor_for_mode(model, args, mode), args, mode)
        results["parameters"] = model.parameters
        results["modes"][mode] = measured
        problems += [f"{mode}: {p}" for p in measured["capture_problems"]]
        save(args, results)
        if problems:
            break
    modes = results["modes"]
    if not problems and {"eager", "graphs"} <= set(modes):
        results["graphs_vs_eager"] = compare_questions(modes["eager"]["answers"],
                                                       modes["graphs"]["answers"])
    for mode in modes.values():
        mode.pop("answers", None)
    save(args, results)
    print(json.dumps(results, indent=1))
    for problem in problems:
        print(f"not graphs: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

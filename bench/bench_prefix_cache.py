"""The prefix cache end to end: three workloads through clef-serve, cache on (the default)
against `--prefix-cache off`, one request at a time, every answer compared.

Not a test. Starts two servers on the same snapshot (by default the tiny one, fp32, CPU), both
with the answer cache off (`--answer-cache 0`: every request reaches a worker) and one worker
each, one with the server's defaults and one with `--prefix-cache off`, and sends each request
to one, then the other, never two at once, so a burst of other work on a shared host falls on
both alike. Workloads (benchlib/prefix_workloads.py):

- (a) agent loop: one state growing by ~150 tokens a turn from ~2,400 to ~6,000 tokens, a
  request with three questions per turn;
- (b) fan-out: one ~7,000-token state asked eight different question sets;
- (c) unrelated: sixteen ~2,400-token requests that share nothing.

Reported per workload and mode: the worker's time (Server-Timing `worker`) of the first turn
and, summed and as a median, of the turns after it; the ratios (off over on) of the sums and of
the medians, and the median of each request's own ratio (it ran on both servers back to back:
the targets are checked on this one, which neither a burst of other work on a shared host nor
a slow drift moves much); the tokens the
cache reused (Server-Timing `prefix;desc="reused=N"`); and the largest difference between the
two modes' answers. Exit status 1 when an answer differs by more than 1.5e-4, a request fails,
or the cache reused nothing in (a) or (b); with `--check-targets` also when (a) or (b) is less
than 3x faster after the first turn (paired), or (c) is slower than off by more than `--noise`.

    python bench/bench_prefix_cache.py --out bench/results/cpu-prefix-cache.json
    python bench/bench_prefix_cache.py --quick        # CI smoke run: small workloads, no file
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import FLASH, SHAPES
from benchlib.gpu_steps import commit_id
from benchlib.paths import TINY_SNAPSHOT
from benchlib.prefix_footprint import footprint
from benchlib.prefix_workloads import (
    ANSWER_TOLERANCE,
    Workload,
    agent_loop,
    fan_out,
    max_difference,
    tokenizer_of,
    unrelated,
)
from benchlib.provenance import command_line, cpu_line
from benchlib.serve import Serve
from clef_worker.serving.prefix.cache import BLOCK_TOKENS_CUDA

WORKER = re.compile(r"(?:^|,\s*)worker;dur=([0-9.]+)")
REUSED = re.compile(r'prefix;desc="reused=(\d+)"')
MODES = ("on", "off")


def timing_of(header: str | None) -> tuple[float, int | None]:
    """The worker's milliseconds and the reused tokens (None: not reported) of one answer."""
    text = header or ""
    worker = WORKER.search(text)
    if worker is None:
        raise AssertionError(f"no worker time in Server-Timing {text!r}")
    reused = REUSED.search(text)
    return float(worker[1]), int(reused[1]) if reused else None


def start_server(model: str, device: str, dtype: str, mode: str,
                 extra: list[str], threads: int | None, shape: str | None = None,
                 layers: int = 0) -> Serve:
    flags = ["--model", model, "--device", device, "--dtype", dtype, "--answer-cache", "0",
             *extra]
    if shape is not None:
        # The model's real shapes with random weights, built in memory by the worker
        # (benchlib.flash_worker; the snapshot's tokenizer and config otherwise), as the GPU
        # sitting's other HTTP steps serve them.
        worker = shlex.join([sys.executable, "-m", "benchlib.flash_worker", "--shape", shape,
                             "--layers", str(layers)])
        flags += ["--worker-command", worker, "--media", "off"]
    if mode == "off":
        flags += ["--prefix-cache", "off"]
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    return Serve(real_worker=True, startup_wait=600, front_args=tuple(flags), env=env)


def run(workloads: list[Workload], servers: dict[str, Serve]) -> dict[str, Any]:
    """Every request to each server in turn; per workload, per mode, its turns' figures."""
    results: dict[str, Any] = {}
    sent = 0
    for workload in workloads:
        turns: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        worst = 0.0
        failures: list[str] = []
        for index, turn in enumerate(workload.turns):
            for mode in MODES:
                turns[mode].append({"turn": index, "worker_ms": 0.0, "reused_tokens": 0,
                                    "input_tokens": 0})
            for body in turn:
                answers: dict[str, bytes] = {}
                sent += 1
                # Which mode goes first alternates, so neither always runs right after the
                # other's forward (caches, frequency) on a shared host.
                for mode in (MODES if sent % 2 else MODES[::-1]):
                    response = servers[mode].post(body)
                    if response.status != 200:
                        failures.append(f"{workload.name} turn {index} ({mode}): "
                                        f"{response.status} {response.body[:200]!r}")
                        continue
                    worker_ms, reused = timing_of(response.header("Server-Timing"))
                    row = turns[mode][-1]
                    row["worker_ms"] = round(row["worker_ms"] + worker_ms, 2)
                    row["reused_tokens"] += reused or 0
                    row["input_tokens"] += response.json().get("usage", {}).get(
                        "input_tokens", 0)
                    answers[mode] = response.body
                if len(answers) == 2:
                    worst = max(worst, max_difference(answers["on"], answers["off"]))
        results[workload.name] = summarise(turns, worst, failures)
        print(json.dumps({"workload": workload.name, **{k: v for k, v in
                          results[workload.name].items() if k != "turns"}}), flush=True)
    return results


def summarise(turns: dict[str, list[dict[str, Any]]], worst: float,
              failures: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"turns": turns, "max_abs_diff": worst, "failures": failures}
    for mode in MODES:
        rows = turns[mode]
        later = [row["worker_ms"] for row in rows[1:]]
        out[mode] = {
            "first_turn_worker_ms": rows[0]["worker_ms"] if rows else None,
            "later_worker_ms_sum": round(sum(later), 1),
            "later_worker_ms_median": round(statistics.median(later), 2) if later else None,
            "reused_tokens": sum(row["reused_tokens"] for row in rows),
            "input_tokens": [rows[0]["input_tokens"], rows[-1]["input_tokens"]] if rows else [],
        }
    on, off = out["on"]["later_worker_ms_sum"], out["off"]["later_worker_ms_sum"]
    out["speedup_after_first"] = round(off / on, 2) if on else None
    on_median, off_median = (out[mode]["later_worker_ms_median"] for mode in MODES)
    out["median_speedup_after_first"] = (round(off_median / on_median, 2)
                                         if on_median else None)
    # Each request ran on both servers back to back: the median of those pairs' ratios is what
    # the targets are checked on, since a burst of other work on a shared host moves a sum, and
    # a slow drift moves both medians, but neither moves a pair much.
    pairs = [off_row["worker_ms"] / on_row["worker_ms"]
             for on_row, off_row in zip(turns["on"][1:], turns["off"][1:], strict=True)
             if on_row["worker_ms"] > 0]
    out["paired_speedup_after_first"] = round(statistics.median(pairs), 2) if pairs else None
    return out


def verdict(results: dict[str, Any], check_targets: bool, noise: float,
            tolerance: float = ANSWER_TOLERANCE) -> list[str]:
    """What is wrong with a run (empty: it passes)."""
    problems: list[str] = []
    for name, result in results.items():
        problems += result["failures"]
        if not result["max_abs_diff"] <= tolerance:
            problems.append(f"{name}: answers differ by {result['max_abs_diff']} "
                            f"(> {tolerance}) between the cache on and off")
        if result["off"]["reused_tokens"]:
            problems.append(f"{name}: --prefix-cache off reused tokens")
    for name in ("agent_loop", "fan_out"):
        if not results[name]["on"]["reused_tokens"]:
            problems.append(f"{name}: the prefix cache reused no token")
        speedup = results[name]["paired_speedup_after_first"]
        if check_targets and (speedup is None or speedup < 3.0):
            problems.append(f"{name}: {speedup}x faster after the first turn (target: 3x)")
    unrelated_speedup = results["unrelated"]["paired_speedup_after_first"]
    if check_targets and (unrelated_speedup is None or unrelated_speedup < 1.0 / (1.0 + noise)):
        problems.append(f"unrelated: the cache on is {unrelated_speedup}x off's speed "
                        f"(slower than off by more than {noise:.0%})")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--agent", type=int, nargs=3, default=[2400, 6000, 150],
                        metavar=("START", "END", "STEP"),
                        help="(a): state tokens at the first and last turn, and per turn")
    parser.add_argument("--fan-out", type=int, nargs=2, default=[7000, 8],
                        metavar=("TOKENS", "SETS"), help="(b): state tokens, question sets")
    parser.add_argument("--unrelated", type=int, nargs=2, default=[16, 2400],
                        metavar=("COUNT", "TOKENS"), help="(c): requests, state tokens each")
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="extra flag for both servers (repeatable), e.g. "
                             "--worker-flag=--prefix-cache-bytes=268435456")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for both workers (on a shared CPU host, 1 avoids "
                             "OpenMP spinning against other processes)")
    parser.add_argument("--check-targets", action="store_true",
                        help="exit 1 unless (a) and (b) are 3x faster after the first turn and "
                             "(c) is no slower than off beyond --noise")
    parser.add_argument("--noise", type=float, default=0.10,
                        help="(c)'s allowance: the cache on may be this much slower (0.10)")
    parser.add_argument("--out", type=Path, default=None, help="write the raw results here")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None,
                        help="serve random weights of this shape built in memory "
                             "(benchlib.flash_model; `flash`: Clef-Flash's real shapes) instead "
                             "of the snapshot's weights")
    parser.add_argument("--layers", type=int, default=0,
                        help="with --shape: override its layer count")
    parser.add_argument("--tolerance", type=float, default=ANSWER_TOLERANCE,
                        help="the largest answer difference between the cache on and off "
                             f"({ANSWER_TOLERANCE} in float32; bfloat16 on a GPU needs the "
                             "self-check's 1e-2)")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: small workloads, CPU, no output file")
    args = parser.parse_args()
    if args.quick:
        args.agent, args.fan_out, args.unrelated = [600, 900, 150], [900, 3], [3, 500]
        args.device = "cpu"
        if args.shape is not None:  # the GPU step's dry run: a small in-memory stack, fp32
            args.shape, args.layers, args.dtype = "small", 2, "float32"
            args.tolerance = ANSWER_TOLERANCE
    tokenizer = tokenizer_of(Path(args.model))
    workloads = [agent_loop(tokenizer, *args.agent), fan_out(tokenizer, *args.fan_out),
                 unrelated(tokenizer, *args.unrelated)]
    started, load_before = time.monotonic(), os.getloadavg()[0]
    servers: dict[str, Serve] = {}
    try:
        for mode in MODES:
            servers[mode] = start_server(args.model, args.device, args.dtype, mode,
                                         args.worker_flag, args.threads, args.shape,
                                         args.layers)
        warm = unrelated(tokenizer, 1, 200, seed=99).requests[0]
        for mode in MODES:  # untimed: first-touch costs
            assert servers[mode].post(warm).status == 200
        results = run(workloads, servers)
        health = {mode: servers[mode].health().json()["workers"][0].get("prefix_cache")
                  for mode in MODES}
    finally:
        for server in servers.values():
            server.close()
    problems = verdict(results, args.check_targets, args.noise, args.tolerance)
    summary = {
        "command": command_line(__file__), "commit": commit_id(), "host": cpu_line(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "model": Path(args.model).name, "shape": args.shape, "layers": args.layers,
        "device": args.device, "dtype": args.dtype, "tolerance": args.tolerance,
        "threads": args.threads,
        "python": platform.python_version(), "seconds": round(time.monotonic() - started, 1),
        "prefix_cache_after": health,  # each server's /health figures after the run
        # Clef-Flash's real shapes (benchlib/flash_model.py, docs/model.md), bfloat16, at the
        # block size of a CUDA worker (where Clef-Flash runs).
        "flash_footprint": footprint(FLASH, block_tokens=BLOCK_TOKENS_CUDA),
        "workloads": {name: {k: v for k, v in result.items() if k != "turns"}
                      for name, result in results.items()},
        "problems": problems,
    }
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({**summary, "turns": {
            name: result["turns"] for name, result in results.items()}}, indent=1) + "\n")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The whole server over HTTP at Clef-Flash's shapes: latency by length, fresh lengths, warm-up,
graph memory and throughput by concurrency, as a client sees them.

Not a test. Starts `clef-serve` on loopback with the in-memory Clef-Flash-shaped worker
(`benchlib/flash_worker.py`: the worker's own loader, warm-up and capture, random weights) and:
- reads the worker's ready info from `/health`: warm-up time, captured graph shapes, graph
  memory; with `--cuda-graphs on` on CUDA it exits 1 unless every length bucket was captured
  (a capture that fell back to eager must not be reported as graphs);
- C1 latency (one keep-alive connection, sequential) at `--lengths` tokens, 3 questions; the
  first length (370 by default) is timed `--p99-samples` times, so its p99 rests on a few
  hundred samples, not on the slowest of thirty;
- fresh lengths: requests at `--fresh` lengths drawn between 1,100 and 8,000 tokens that no
  earlier request had, first request against the median of three repeats (target <= 1.5x);
- throughput: requests/s and latency at each `--concurrency`, closed loop, `--seconds` each;
- mixed throughput: the same at each `--mixed-concurrency`, the requests cycling through
  `--mixed-lengths` (those within `--max-length`): where packing can win over padding, which a
  single length cannot show.

Every figure is a forward: the server runs with its answer cache off (`--answer-cache 0`; the
benchmark repeats bodies, which the production default would answer from the cache in
microseconds), and the result records `answer_cache_hits`, read from the server's `/metrics`
after each phase (0 unless a cached answer slipped in). It also records the worker's start-up
self-check (`self_check`, from `/health`'s `worker.self_check`; None where the worker does not
report one), run with `--self-check report` (compare and record, never fall back to a slower
layout, never reuse a kept verdict), its time (`self_check_ms`) and the time from the server's
spawn to ready (`ready_s`, the self-check included).

The phases run in the order a time limit should cut them: throughput by concurrency and the
mixed lengths first, then latency by length (the first length with its p99 samples, then the
longer ones), then fresh lengths.
`--warmup-only` stops after the ready info (the warm-cache start-up figure). `--batch-layout`
and `--max-batch-tokens` choose the worker's batch policy (packed and padded side by side in the
GPU script). The result is written to `--out` after every phase, so a run stopped at its time
limit keeps what it measured (`"phase"` says how far it got).

    python bench/bench_gpu_http.py --cuda-graphs on --out graphs.json          # on a GPU host
    python bench/bench_gpu_http.py --cuda-graphs on --workers-per-device 2 --lengths \\
        --fresh 0 --concurrency 16 32
    python bench/bench_gpu_http.py --quick     # CPU smoke run: small shapes, no file
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import BUILT, SHAPES, RequestSizer, make_request
from benchlib.gpu_checks import cache_hits, capture_problems, capture_report
from benchlib.http_client import Client
from benchlib.http_load import run_mixed_load
from benchlib.provenance import command_line
from benchlib.serve import Serve
from benchlib.timing import latency_summary, timed_ms

FRESH_RANGE = (1100, 8000)
# The mixed-length phase's requests, in turn: Clef's spread of short and long prompts, all
# within the padded step's --max-length 1024 so packed and padded see the same mix.
MIXED_LENGTHS = (90, 150, 250, 370, 520, 700, 850, 1000)
# Every request is a forward: the benchmark repeats bodies, which the answer cache would answer.
NO_ANSWER_CACHE = ("--answer-cache", "0")
# The worker's start-up self-check compares and records, never falls back and never reuses a
# kept verdict: the figures are the layout asked for, and the check's own cost is measured.
SELF_CHECK_REPORT = ("--self-check", "report")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="flash")
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="on")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--batch-layout", choices=("auto", "packed", "padded"), default="auto")
    parser.add_argument("--max-batch-tokens", type=int, default=0, help="0: by device")
    parser.add_argument("--workers-per-device", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="*", default=[370, 1000, 7000])
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=50, help="timed requests per length")
    parser.add_argument("--p99-samples", type=int, default=300,
                        help="timed requests at the first length (its p99 needs hundreds)")
    parser.add_argument("--mixed-concurrency", type=int, nargs="*", default=[16],
                        help="concurrencies of the mixed-length phase (none: skip it)")
    parser.add_argument("--mixed-lengths", type=int, nargs="*", default=list(MIXED_LENGTHS))
    parser.add_argument("--fresh", type=int, default=8, help="fresh lengths to try")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 16, 32])
    parser.add_argument("--seconds", type=float, default=8.0, help="per concurrency")
    parser.add_argument("--warmup-only", action="store_true")
    parser.add_argument("--startup-timeout", type=float, default=400.0)
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: small shapes, few requests")
    parser.add_argument("server_args", nargs="*", help="more clef-serve flags (after --)")
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.shape, args.layers, args.dtype, args.gdn_prefill = (
            "cpu", "small", 2, "float32", "torch")
        args.max_length, args.lengths, args.repeat, args.fresh = 512, [370], 3, 1
        # The concurrency levels stay the plan's (C16 and C32 as on the GPU, so the dry run
        # fills the same summary fields), one second each.
        args.seconds, args.p99_samples = 1.0, 20
        # A budget of five requests of 370 tokens: warm-up builds the 19 small shapes up to
        # it, not the 22 up to the CPU default's 4,096 (the dry run's warm-up steps once took
        # 78 s of their 100 on a loaded 2-core host building those).
        args.max_batch_tokens = 2048
        args.fresh_range = (300, 500)
    else:
        args.fresh_range = FRESH_RANGE
    return args


def server_flags(args: argparse.Namespace) -> tuple[str, ...]:
    worker = shlex.join([sys.executable, "-m", "benchlib.flash_worker", "--shape", args.shape,
                         "--layers", str(args.layers)])
    return ("--worker-command", worker, "--device", args.device, "--dtype", args.dtype,
            "--gdn-prefill", args.gdn_prefill, "--cuda-graphs", args.cuda_graphs,
            "--max-length", str(args.max_length), "--media", "off",
            "--batch-layout", args.batch_layout, "--max-batch-tokens", str(args.max_batch_tokens),
            "--workers-per-device", str(args.workers_per_device), *NO_ANSWER_CACHE,
            *SELF_CHECK_REPORT, *args.server_args)


def post_ms(client: Client, body: bytes) -> float:
    def call() -> None:
        client.send("POST", "/v1/systemone", body)
        response = client.read_response()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {response.body[:200]!r}")

    return timed_ms(call)


def latency(client: Client, sizer: RequestSizer, args: argparse.Namespace,
            out: dict[str, Any], saved: Callable[[], None]) -> dict[str, Any]:
    """C1 latency at each length into `out`, `saved` after each (a time limit keeps those
    measured)."""
    for index, tokens in enumerate(args.lengths):
        if tokens > args.max_length:
            continue
        request = make_request(sizer, tokens, args.questions)
        body = json.dumps(request).encode()
        for _ in range(3):
            post_ms(client, body)
        repeat = args.repeat if tokens <= 2000 else max(5, args.repeat // 4)
        if index == 0:
            repeat = max(repeat, args.p99_samples)
        out[str(tokens)] = {"input_tokens": len(sizer.encode(request).input_ids),
                            **latency_summary([post_ms(client, body) for _ in range(repeat)])}
        print(f"C1 {tokens} tokens: {out[str(tokens)]}", file=sys.stderr, flush=True)
        saved()
    return out


def fresh_lengths(client: Client, sizer: RequestSizer,
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """The first request at a length never sent before, against repeats of the same one."""
    rng = random.Random(0)
    low, high = args.fresh_range
    out = []
    for target in sorted(rng.sample(range(low, min(high, args.max_length)), args.fresh)):
        request = make_request(sizer, target, args.questions)
        # A distinct state per length, so no earlier request had exactly these tokens.
        request["state"] = f"case {target}: " + request["state"]
        body = json.dumps(request).encode()
        first = post_ms(client, body)
        warm = latency_summary([post_ms(client, body) for _ in range(3)])["p50_ms"]
        out.append({"tokens": len(sizer.encode(request).input_ids), "first_ms": round(first, 2),
                    "warm_ms": warm, "ratio": round(first / warm, 2)})
    return out


def load_by_concurrency(port: int, bodies: list[bytes], concurrencies: list[int],
                        seconds: float, label: str) -> dict[str, Any]:
    """Closed-loop load at each concurrency, the requests taking `bodies` in turn."""
    out: dict[str, Any] = {}
    for connections in concurrencies:
        result = run_mixed_load("127.0.0.1", port, "POST", "/v1/systemone", bodies,
                                connections=connections, seconds=seconds)
        out[f"C{connections}"] = {"req_per_s": round(result.throughput, 1),
                                  "p50_ms": round(result.p50_ms, 2),
                                  "p99_ms": round(result.p99_ms, 2),
                                  "requests": result.requests, "failed": result.bad_status}
        print(f"{label}C{connections}: {out[f'C{connections}']}", file=sys.stderr, flush=True)
        if result.bad_status:
            raise RuntimeError(f"{label}C{connections}: {result.bad_status} requests failed")
    return out


def throughput(port: int, sizer: RequestSizer, args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps(make_request(sizer, 370 if args.max_length >= 370 else 100,
                                   args.questions)).encode()
    return load_by_concurrency(port, [body], args.concurrency, args.seconds, "")


def mixed_throughput(port: int, sizer: RequestSizer,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Closed-loop load cycling through requests of mixed lengths, at each concurrency."""
    lengths = [n for n in args.mixed_lengths if n <= args.max_length]
    bodies = [json.dumps(make_request(sizer, n, args.questions)).encode() for n in lengths]
    concurrencies = args.mixed_concurrency if bodies else []
    return {"lengths": lengths,
            **load_by_concurrency(port, bodies, concurrencies, args.seconds, "mixed ")}


def answer_cache_hits(server: Serve) -> int | None:
    """The server's answer-cache hits so far, from /metrics (None when it cannot be read)."""
    response = server.request("GET", "/metrics")
    return cache_hits(response.body.decode()) if response.status == 200 else None


def worker_lines(log: str) -> list[dict[str, str]]:
    """Each worker's `worker ready:` log line as fields (warm-up and graph memory per worker:
    `/health` shows the first ready worker's info only)."""
    wanted = ("slot", "pid", "warmup_ms", "graph_memory_bytes", "captured", "cuda_graphs")
    out = []
    for line in log.splitlines():
        if "worker ready:" in line:
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            out.append({key: fields[key] for key in wanted if key in fields})
    return out


def device_memory_used_mib() -> list[int] | None:
    """Memory in use on each GPU (every process on it), from nvidia-smi; None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                           "nounits"], capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        return None
    return [int(line) for line in done.stdout.split() if line.strip().isdigit()]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    results: dict[str, Any] = {"command": command_line(__file__), "shape": args.shape,
                               "cuda_graphs": args.cuda_graphs,
                               "batch_layout": args.batch_layout,
                               "workers_per_device": args.workers_per_device, "phase": "start"}

    def done(phase: str, server: Serve) -> None:
        """Record the phase reached and the cache hits, and write what is measured so far."""
        results["phase"] = phase
        results["answer_cache_hits"] = answer_cache_hits(server)
        save(results, args.out)

    sizer = RequestSizer()
    started = time.perf_counter()
    with Serve(front_args=server_flags(args), real_worker=True, max_batch=None,
               startup_wait=args.startup_timeout) as server:
        results["ready_s"] = round(time.perf_counter() - started, 1)
        server.wait_for(BUILT % args.shape)  # the in-memory model is the one being served
        health = server.health().json()
        info = health.get("worker") or {}
        results["warmup_ms"] = info.get("warmup_ms")
        results["workers"] = worker_lines(server.stderr)
        results["device_memory_used_mib"] = device_memory_used_mib()
        results["capture"] = capture_report(info)
        results["self_check"] = info.get("self_check")
        results["self_check_ms"] = (info.get("self_check") or {}).get("ms")
        problems = capture_problems(info, graphs_requested=args.cuda_graphs == "on",
                                    on_cuda=args.device.startswith("cuda"))
        results["capture_problems"] = problems
        done("ready", server)
        if problems or args.warmup_only:
            return results, problems
        results["throughput"] = throughput(server.port, sizer, args)
        done("throughput", server)
        results["mixed_throughput"] = mixed_throughput(server.port, sizer, args)
        done("mixed_throughput", server)
        with server.connect(timeout=120) as client:
            results["latency"] = {}
            latency(client, sizer, args, results["latency"], lambda: done("latency", server))
            results["fresh_lengths"] = fresh_lengths(client, sizer, args)
        results["fresh_max_ratio"] = max((f["ratio"] for f in results["fresh_lengths"]),
                                         default=None)
        done("fresh_lengths", server)
    return results, problems


def save(results: dict[str, Any], path: str | None) -> None:
    """Write the results so far (atomically: a reader never sees half a file)."""
    if not path:
        return
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(results, indent=1))
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, problems = run(args)
    results["phase"] = "done"
    save(results, args.out)
    print(json.dumps(results, indent=1))
    for problem in problems:
        print(f"not graphs: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

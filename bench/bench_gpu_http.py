"""The whole server over HTTP at Clef-Flash's shapes: latency by length, fresh lengths, warm-up,
graph memory and throughput by concurrency, as a client sees them.

Not a test. Starts `clef-serve` on loopback with the in-memory Clef-Flash-shaped worker
(`benchlib/flash_worker.py`: the worker's own loader, warm-up and capture, random weights) and:
- reads the worker's ready info from `/health`: warm-up time, captured graph shapes, graph
  memory; with `--cuda-graphs on` on CUDA it exits 1 unless every length bucket was captured
  (a capture that fell back to eager must not be reported as graphs);
- start-up: the time from spawn to ready (`ready_s`), the worker's own phases (`startup`, read
  by key from `/health` where the worker reports them), and, last of all, `restart_ready_s`:
  the worker is killed (SIGKILL, as a crash) and the time until `/health` shows a new one
  ready, at the production restart delay;
- fresh states (what users send: benchlib/gpu_workloads.py): C1 latency at `--state-lengths`
  tokens, every request's state distinct (>= 256 tokens: each stores points and none can
  reuse any), the worker's reused tokens from Server-Timing recorded (0 expected), the
  longest length's p50 against its bucket's replay from the warm-up table;
- prefix hits: a `--hit` state stored once, then requests that each add their own new tokens
  after it (reused tokens recorded);
- throughput: requests/s and latency at each `--concurrency`, closed loop, `--seconds` each,
  every request a distinct state of `--throughput-tokens` tokens (no cache can answer);
- mixed throughput: the same at each `--mixed-concurrency`, the requests cycling through
  `--mixed-lengths` (those within `--max-length`), each a distinct state: where packing can
  win over padding, which a single length cannot show;
- fresh lengths: requests at `--fresh` lengths drawn between 1,100 and 8,000 tokens that no
  earlier request had, the first against the median of three more distinct states at that
  length (each a fresh forward; target <= 1.5x);
- C1 latency (one keep-alive connection, sequential) at `--lengths` tokens, one body repeated
  (its state short enough to store nothing); the first length (370 by default) is timed
  `--p99-samples` times, so its p99 rests on a few hundred samples.

Every figure is a forward: the server runs with its answer cache off (`--answer-cache 0`; the
benchmark repeats bodies, which the production default would answer from the cache in
microseconds), and the result records `answer_cache_hits`, read from the server's `/metrics`
after each phase (0 unless a cached answer slipped in). It also records the worker's start-up
self-check (`self_check`, from `/health`'s `worker.self_check`; None where the worker does not
report one), run with `--self-check report` (compare and record, never fall back to a slower
layout, never reuse a kept verdict), its time (`self_check_ms`) and the time from the server's
spawn to ready (`ready_s`, the self-check included).

The phases run in the order a time limit should cut them: fresh states and prefix hits first
(what the last sitting lacked), throughput and mixed lengths, fresh lengths, the repeated short
body, and the worker restart last (`--restart` off skips it).
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
import dataclasses
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import BUILT, SHAPES, RequestSizer, make_request
from benchlib.gpu_checks import cache_hits, capture_problems, capture_report
from benchlib.gpu_workloads import (
    DistinctStates,
    HitBodies,
    bucket_replay_ms,
    replay_table,
    timing_of,
)
from benchlib.http_client import Client
from benchlib.http_load import run_generated_load
from benchlib.provenance import command_line
from benchlib.serve import Serve
from benchlib.timing import latency_summary, timed_ms
from clef_dispatch.settings import WorkerSettings

FRESH_RANGE = (1100, 8000)
# The mixed-length phase's requests, in turn: Clef's spread of short and long prompts, all
# within the padded step's --max-length 1024 so packed and padded see the same mix.
MIXED_LENGTHS = (90, 150, 250, 370, 520, 700, 850, 1000)
# Every request is a forward: the benchmark repeats bodies, which the answer cache would answer.
NO_ANSWER_CACHE = ("--answer-cache", "0")
# The worker's start-up self-check compares and records, never falls back and never reuses a
# kept verdict: the figures are the layout asked for, and the check's own cost is measured.
SELF_CHECK_REPORT = ("--self-check", "report")
# benchlib.serve shortens the restart delay for tests; the restart figure is a user's, so the
# server here restarts a dead worker after the production delay.
PRODUCTION_RESTART = ("--restart-backoff", str(
    {f.name: f.default for f in dataclasses.fields(WorkerSettings)}["restart_backoff"]))


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
    parser.add_argument("--lengths", type=int, nargs="*", default=[370],
                        help="C1 lengths of one repeated body (its state short: no store)")
    parser.add_argument("--state-lengths", type=int, nargs="*", default=[400, 1000, 7000],
                        help="C1 lengths over distinct states >= 256 tokens (fresh forwards)")
    parser.add_argument("--state-repeat", type=int, default=20,
                        help="timed requests per state length (a quarter past 2,000 tokens)")
    parser.add_argument("--hit", type=int, nargs=2, default=[6600, 400],
                        metavar=("PREFIX", "NEW"),
                        help="prefix hits: the stored state's tokens and each hit's new ones "
                             "(0 0: skip)")
    parser.add_argument("--hit-repeat", type=int, default=15, help="timed hits")
    parser.add_argument("--throughput-tokens", type=int, default=400,
                        help="tokens of the throughput phase's distinct-state requests")
    parser.add_argument("--restart", choices=("on", "off"), default="on",
                        help="end by killing the worker and timing its restart to ready")
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
        # Fresh states and hits within the quick mode's 512 tokens (the GPU's 7,000-token
        # figures stay null in a dry run).
        # (Each only where the command asked for it: a step may turn them off.)
        args.state_lengths = [400] if args.state_lengths else []
        args.state_repeat = 3
        args.hit = [260, 100] if any(args.hit) else [0, 0]
        args.hit_repeat = 3
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
            *SELF_CHECK_REPORT, *PRODUCTION_RESTART, *args.server_args)


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


def fresh_lengths(client: Client, states: DistinctStates,
                  args: argparse.Namespace) -> list[dict[str, Any]]:
    """The first request at a length never sent before against the median of three more at
    that length, every one a distinct state (each a fresh forward: no cache can answer it)."""
    rng = random.Random(0)
    low, high = args.fresh_range
    out = []
    for target in sorted(rng.sample(range(low, min(high, args.max_length)), args.fresh)):
        first_body = states.body(target)
        first, first_reused = post_timed(client, first_body)
        warm = [post_timed(client, states.body(target)) for _ in range(3)]
        warm_ms = latency_summary([ms for ms, _ in warm])["p50_ms"]
        out.append({"tokens": states.encoded_tokens(first_body), "first_ms": round(first, 2),
                    "warm_ms": warm_ms, "ratio": round(first / warm_ms, 2),
                    "reused_tokens_max": max([first_reused, *(r for _, r in warm)])})
    return out


def post_timed(client: Client, body: bytes) -> tuple[float, int]:
    """One request's client-side milliseconds and the tokens its worker reused."""
    reused = 0

    def call() -> None:
        nonlocal reused
        client.send("POST", "/v1/systemone", body)
        response = client.read_response()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {response.body[:200]!r}")
        reused = timing_of(response.header("Server-Timing"))[1]

    return timed_ms(call), reused


def state_latency(client: Client, states: DistinctStates, args: argparse.Namespace,
                  replays: dict[str, float], out: dict[str, Any],
                  saved: Callable[[], None]) -> None:
    """C1 latency at each `--state-lengths` over distinct states (two untimed first), into
    `out`; the reused tokens prove no request hit a cache, and each length's p50 is set
    against the replay of the graph bucket that holds it."""
    for tokens in args.state_lengths:
        if tokens > args.max_length:
            continue
        for _ in range(2):
            post_timed(client, states.body(tokens))
        repeat = args.state_repeat if tokens <= 2000 else max(5, args.state_repeat // 4)
        bodies = [states.body(tokens) for _ in range(repeat)]
        timed = [post_timed(client, body) for body in bodies]
        row: dict[str, Any] = {"input_tokens": states.encoded_tokens(bodies[0]),
                               "state_tokens": states.state_tokens(tokens),
                               "reused_tokens_max": max(r for _, r in timed),
                               **latency_summary([ms for ms, _ in timed])}
        bucket = bucket_replay_ms(replays, row["input_tokens"])
        if bucket is not None:
            row["bucket"], row["bucket_replay_ms"] = bucket[0], round(bucket[1], 2)
            row["vs_bucket_replay"] = round(row["p50_ms"] / bucket[1], 2) if bucket[1] else None
        out[str(tokens)] = row
        print(f"C1 fresh states, {tokens} tokens: {row}", file=sys.stderr, flush=True)
        saved()


def prefix_hits(client: Client, hits: HitBodies, repeat: int) -> dict[str, Any]:
    """The stored state sent once (it stores its points), then `repeat` requests that keep it
    and add their own new tokens; each one's latency and the tokens its worker reused."""
    store_ms, _ = post_timed(client, hits.store_body())
    post_timed(client, hits.next_body())  # untimed: the first hit's lazy costs
    timed = [post_timed(client, hits.next_body()) for _ in range(repeat)]
    reused = [r for _, r in timed]
    return {"store_ms": round(store_ms, 2), "reused_tokens_min": min(reused),
            "reused_tokens_max": max(reused), **latency_summary([ms for ms, _ in timed])}


def load_by_concurrency(port: int, body_for: Callable[[int], bytes], concurrencies: list[int],
                        seconds: float, label: str) -> dict[str, Any]:
    """Closed-loop load at each concurrency, request n sending `body_for(n)`."""
    out: dict[str, Any] = {}
    for connections in concurrencies:
        result = run_generated_load("127.0.0.1", port, "POST", "/v1/systemone", body_for,
                                    connections=connections, seconds=seconds)
        out[f"C{connections}"] = {"req_per_s": round(result.throughput, 1),
                                  "p50_ms": round(result.p50_ms, 2),
                                  "p99_ms": round(result.p99_ms, 2),
                                  "requests": result.requests, "failed": result.bad_status}
        print(f"{label}C{connections}: {out[f'C{connections}']}", file=sys.stderr, flush=True)
        if result.bad_status:
            raise RuntimeError(f"{label}C{connections}: {result.bad_status} requests failed")
    return out


def throughput(server: Serve, states: DistinctStates,
               args: argparse.Namespace) -> dict[str, Any]:
    """Closed-loop load over distinct states of `--throughput-tokens` tokens (>= 256-token
    states: what users send), and the tokens the prefix cache reused meanwhile (0 expected)."""
    tokens = min(args.throughput_tokens, args.max_length)
    before = prefix_reused(server)
    out = load_by_concurrency(server.port, lambda _: states.body(tokens), args.concurrency,
                              args.seconds, "")
    after = prefix_reused(server)
    return {"tokens": tokens, "state_tokens": states.state_tokens(tokens),
            "reused_tokens": _delta(before, after), **out}


def mixed_throughput(server: Serve, states: DistinctStates,
                     args: argparse.Namespace) -> dict[str, Any]:
    """Closed-loop load cycling through distinct states of mixed lengths, at each
    concurrency."""
    lengths = [n for n in args.mixed_lengths if n <= args.max_length]
    concurrencies = args.mixed_concurrency if lengths else []
    before = prefix_reused(server)
    out = load_by_concurrency(server.port, lambda n: states.body(lengths[n % len(lengths)]),
                              concurrencies, args.seconds, "mixed ")
    after = prefix_reused(server)
    return {"lengths": lengths,
            "input_tokens": [states.encoded_tokens(states.body(n)) for n in lengths],
            "reused_tokens": _delta(before, after), **out}


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def prefix_reused(server: Serve) -> int | None:
    """The tokens the first worker's prefix cache has reused so far (None: not reported)."""
    workers = server.health().json().get("workers") or [{}]
    cache = workers[0].get("prefix_cache") if isinstance(workers[0], dict) else None
    return cache.get("tokens_reused") if isinstance(cache, dict) else None


def startup_of(health: dict[str, Any]) -> Any:
    """The worker's start-up phases as `/health` reports them, wherever it puts them (the
    top level, the worker's info, or the first worker's entry); None where it reports none."""
    workers = health.get("workers") or [{}]
    for place in (health, health.get("worker") or {}, workers[0] or {}):
        if isinstance(place, dict) and place.get("startup") is not None:
            return place["startup"]
    return None


def restart(server: Serve, timeout: float) -> dict[str, Any]:
    """Kill the worker (SIGKILL, as a crash) and time until `/health` shows a new one ready;
    what the new worker reported about its start (its self-check, its phases)."""
    before = server.health().json()
    old = (before.get("workers") or [{}])[0].get("pid")
    if not old:
        return {"error": "/health names no worker pid"}
    started = time.perf_counter()
    os.kill(int(old), signal.SIGKILL)
    # The supervisor's ready line for a worker of another pid marks the moment (waiting on the
    # log, not polling /health: a poll every few ms would crowd the log and the front).
    server.wait_for(re.compile(rf"worker ready:.* pid=(?!{int(old)}\b)\d+"), timeout=timeout)
    ready_s = round(time.perf_counter() - started, 2)

    def back(document: dict[str, Any]) -> bool:
        worker = (document.get("workers") or [{}])[0]
        return worker.get("status") == "ready" and worker.get("pid") not in (None, old)

    health = server.wait_health(back, timeout=timeout)
    check = (health.get("worker") or {}).get("self_check") or {}
    return {"ready_s": ready_s, "self_check_ms": check.get("ms"),
            "self_check_reused": check.get("reused"), "startup": startup_of(health),
            "kernel_cache": (health.get("worker") or {}).get("kernel_cache")}


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
    # One question (136 tokens with the prompt around it), so a ~400-token request carries a
    # state of 256 tokens or more, as the fresh-state targets ask; the mixed phase's states
    # may be short (its lengths start at 90 tokens) but are just as distinct.
    questions = make_request(sizer, 0, 1)["questions"]

    def count(request: dict[str, Any]) -> int:
        return len(sizer.encode(request).input_ids)

    states = DistinctStates(sizer.encoder.tokenizer, count, questions)
    short_states = DistinctStates(sizer.encoder.tokenizer, count, questions, min_state=16)
    # The bodies' texts are built while the server starts (seconds for 7,000 tokens).
    lengths = [n for n in (*args.state_lengths, args.throughput_tokens) if n <= args.max_length]
    building = threading.Thread(target=states.prepare, args=(lengths,), daemon=True)
    building.start()
    started = time.perf_counter()
    with Serve(front_args=server_flags(args), real_worker=True, max_batch=None,
               startup_wait=args.startup_timeout) as server:
        results["ready_s"] = round(time.perf_counter() - started, 1)
        building.join()
        server.wait_for(BUILT % args.shape)  # the in-memory model is the one being served
        health = server.health().json()
        info = health.get("worker") or {}
        results["warmup_ms"] = info.get("warmup_ms")
        results["startup"] = startup_of(health)
        results["kernel_cache"] = info.get("kernel_cache")
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
        with server.connect(timeout=120) as client:
            results["state_latency"] = {}
            state_latency(client, states, args, replay_table(server.stderr),
                          results["state_latency"], lambda: done("state_latency", server))
            prefix, new = args.hit
            if prefix and prefix + new + states.base_tokens <= args.max_length:
                hits = HitBodies(sizer.encoder.tokenizer, questions, prefix, new)
                results["prefix_hit"] = {"prefix_tokens": prefix, "new_tokens": new,
                                         **prefix_hits(client, hits, args.hit_repeat)}
                print(f"C1 prefix hits: {results['prefix_hit']}", file=sys.stderr, flush=True)
                done("prefix_hit", server)
        results["throughput"] = throughput(server, states, args)
        done("throughput", server)
        results["mixed_throughput"] = mixed_throughput(server, short_states, args)
        done("mixed_throughput", server)
        with server.connect(timeout=120) as client:
            results["fresh_lengths"] = fresh_lengths(client, states, args)
            results["fresh_max_ratio"] = max((f["ratio"] for f in results["fresh_lengths"]),
                                             default=None)
            done("fresh_lengths", server)
            results["latency"] = {}
            latency(client, sizer, args, results["latency"], lambda: done("latency", server))
        if args.restart == "on":
            results["restart"] = restart(server, args.startup_timeout)
            print(f"restart: {results['restart']}", file=sys.stderr, flush=True)
            done("restart", server)
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

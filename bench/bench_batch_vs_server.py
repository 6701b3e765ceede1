"""`clef-batch` beside the server: the same requests, the same worker flags, rounds taking turns.

Not a test. Each round starts `clef-serve` with the model flags given after `--`, loads it with
`clef-bench` (C1 and C8 by default, keep-alive clients, a few warm-up requests first), stops it,
then runs `clef-batch` on a JSONL file of as many requests of the same body with the same flags.
The batch rate is counted from the worker's `ready` to clef-batch's "every request answered"
line (the worker's load, warm-up and exit are left out on both sides: the server pays the first
two before its port opens). Medians over the rounds are printed as JSON; `--out FILE` also
writes them (bench/results/).

    python bench/bench_batch_vs_server.py -- --model demo --device cpu
    python bench/bench_batch_vs_server.py --requests 192 --rounds 3 --out cpu-batch-vs-server.json
    python bench/bench_batch_vs_server.py --quick      # a tiny run on CPU, writes nothing (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.paths import REPO
from benchlib.provenance import command_line, cpu_line
from clef_tools.bench_body import generated_body

LISTENING = re.compile(r"listening on (http://\S+:\d+)")
STARTUP_SECONDS = 600.0


class Lines:
    """A child's stderr, read by a thread; `wait_for` returns (match, when it was read)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.seen: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._changed:
                self.seen.append((time.perf_counter(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str | re.Pattern[str],
                 timeout: float = STARTUP_SECONDS) -> tuple[re.Match[str], float]:
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for when, line in self.seen:
                    if match := regex.search(line):
                        return match, when
                if time.monotonic() > deadline or not self._thread.is_alive():
                    tail = "\n".join(line for _, line in self.seen[-20:])
                    raise RuntimeError(f"no line matching {regex.pattern!r}:\n{tail}")
                self._changed.wait(0.5)


def _spawn(argv: list[str]) -> Lines:
    process = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               errors="replace", env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return Lines(process)


def server_round(flags: list[str], args: argparse.Namespace, scratch: Path) -> dict[int, Any]:
    """clef-bench against a fresh clef-serve: {concurrency: report row}."""
    server = _spawn([sys.executable, "-m", "clef_frontend", "--port", "0", *flags])
    try:
        url = server.wait_for(LISTENING)[0][1]
        out = scratch / "bench"
        subprocess.run([sys.executable, "-m", "clef_tools.bench", url, "--requests",
                        str(args.requests), "--concurrency", *map(str, args.concurrency),
                        "--tokens", str(args.tokens), "--questions", str(args.questions),
                        "--warmup", str(args.warmup), "--out", str(out)],
                       cwd=REPO, check=True, stdin=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        report = json.loads((out / "report.json").read_text())
    finally:
        server.process.terminate()
        server.process.wait(120)
    return {row["concurrency"]: row for row in report["runs"]}


def batch_round(flags: list[str], args: argparse.Namespace, scratch: Path) -> float:
    """clef-batch on as many requests: answers per second from the worker's ready."""
    source, output = scratch / "in.jsonl", scratch / "out.jsonl"
    body = json.loads(generated_body(args.tokens, args.questions))
    source.write_text("".join(json.dumps({"custom_id": f"r{i}", "body": body}) + "\n"
                              for i in range(args.requests)))
    output.unlink(missing_ok=True)
    batch = _spawn([sys.executable, "-m", "clef_tools.batch", "--input", str(source),
                    "--output", str(output), *flags])
    _, ready = batch.wait_for(r"worker ready")
    _, done = batch.wait_for(r"every request answered")
    code = batch.process.wait(120)
    answered = sum(1 for line in output.read_text().splitlines()
                   if json.loads(line)["response"]["status_code"] == 200)
    if code != 0 or answered != args.requests:
        raise RuntimeError(f"clef-batch exited {code} with {answered}/{args.requests} answered")
    return args.requests / (done - ready)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="also write the result here")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run (16 requests, one round, demo snapshot on CPU), no writes")
    parser.add_argument("flags", nargs="*", help="model flags for both, after --")
    args = parser.parse_args()
    flags = args.flags or ["--model", "demo", "--device", "cpu"]
    if args.quick:
        args.requests, args.rounds, args.tokens, args.warmup, args.out = 16, 1, 60, 2, None
        flags = ["--model", "demo", "--device", "cpu"]
    load_before = os.getloadavg()[0]
    servers: list[dict[int, Any]] = []
    batches: list[float] = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(args.rounds):
            servers.append(server_round(flags, args, Path(scratch)))
            batches.append(batch_round(flags, args, Path(scratch)))
            print(f"round {number + 1}: server "
                  + ", ".join(f"C{c} {row['throughput_rps']:.1f}"
                              for c, row in servers[-1].items())
                  + f" req/s; clef-batch {batches[-1]:.1f} req/s", file=sys.stderr, flush=True)
    result = {
        "command": command_line(__file__),
        "machine": cpu_line(),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "requests": args.requests, "tokens": args.tokens, "questions": args.questions,
        "rounds": args.rounds,
        "server": {str(c): {
            "throughput_rps": round(statistics.median(r[c]["throughput_rps"] for r in servers), 1),
            "rounds_rps": [r[c]["throughput_rps"] for r in servers],
            "p50_ms": round(statistics.median(r[c]["p50_ms"] for r in servers), 1),
            "p99_ms": round(statistics.median(r[c]["p99_ms"] for r in servers), 1),
        } for c in args.concurrency},
        "batch": {"throughput_rps": round(statistics.median(batches), 1),
                  "rounds_rps": [round(rate, 1) for rate in batches]},
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if any(row["errors"] for r in servers for row in r.values()):
        print("some server requests failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU script's steps under one deadline, and the summary it leaves behind.

On a GPU host the whole check is one command of at most 10 minutes (`bench/gpu_session.sh`,
default deadline 540 s after its own setup). Steps run one at a time in priority order, each
under its own time limit; a step whose limit does not fit in the time left is not started but
skipped, and reported as such, so the most important numbers always come first and the command
always ends inside its deadline. The first step pays the cold kernel compilation (Triton and
fla autotuning with an empty cache), so it has the largest limit; later steps share its cache.

Every step writes its JSON result to a scratch folder; at the end one summary with the fixed
fields of `SUMMARY_FIELDS` (null where a step did not run or failed) is written as
`h200-YYYY-MM-DD-summary.json`, beside `steps.jsonl` (each step's status, time, exit code,
reason and result) and `logs.txt` (their stderr). `--dry-run` runs the same plan in each
script's `--quick` mode on CPU, which exercises the scheduler and the summary writer in CI.

The scheduling (`run_steps`) and the summary (`summarise`) take the clock and the step runner
as arguments, so they are unit-tested without CUDA or subprocesses.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib.paths import FIXTURES, REPO

DEFAULT_DEADLINE_S = 540.0
# A dry run's steps are CPU quick runs on a shared CI machine: same plan and order, limits (and
# the deadline gpu_session.sh gives) scaled by this, so a slow CI host does not fail the check
# of the wiring.
DRY_RUN_SCALE = 2.0
# Kept back from the deadline for writing the summary after the last step.
RESERVE_S = 10.0
LOG_TAIL_BYTES = 8 << 20
STDOUT_TAIL_CHARS = 4000

SUMMARY_FIELDS = (
    "date", "commit", "p50_ms_370tok", "p99_ms_370tok", "p50_ms_1000tok", "p50_ms_7000tok",
    "fresh_len_max_ratio", "warmup_cold_s", "warmup_cached_s", "c1_rps", "c16_rps", "c32_rps",
    "two_workers_c16_rps", "graph_memory_bytes", "bf16_graphs_vs_eager_max_prob_diff",
    "argmax_equal",
)


def _ms_to_s(value: Any) -> float:
    return round(float(value) / 1000.0, 2)


# field: (step, path into that step's JSON result, conversion)
SOURCES: dict[str, tuple[str, tuple[str, ...], Callable[[Any], Any] | None]] = {
    "p50_ms_370tok": ("http_graphs_cold", ("latency", "370", "p50_ms"), None),
    "p99_ms_370tok": ("http_graphs_cold", ("latency", "370", "p99_ms"), None),
    "p50_ms_1000tok": ("http_graphs_cold", ("latency", "1000", "p50_ms"), None),
    "p50_ms_7000tok": ("http_graphs_cold", ("latency", "7000", "p50_ms"), None),
    "fresh_len_max_ratio": ("http_graphs_cold", ("fresh_max_ratio",), None),
    "warmup_cold_s": ("http_graphs_cold", ("warmup_ms",), _ms_to_s),
    "warmup_cached_s": ("warmup_cached", ("warmup_ms",), _ms_to_s),
    "c1_rps": ("http_graphs_cold", ("throughput", "C1", "req_per_s"), None),
    "c16_rps": ("http_graphs_cold", ("throughput", "C16", "req_per_s"), None),
    "c32_rps": ("http_graphs_cold", ("throughput", "C32", "req_per_s"), None),
    "two_workers_c16_rps": ("two_workers", ("throughput", "C16", "req_per_s"), None),
    "graph_memory_bytes": ("http_graphs_cold", ("capture", "graph_memory_bytes"), None),
    "bf16_graphs_vs_eager_max_prob_diff": (
        "parity_bf16", ("graphs_vs_eager", "max_abs_probability_diff"), None),
    "argmax_equal": ("parity_bf16", ("graphs_vs_eager", "argmax_equal"), None),
}


@dataclass(frozen=True)
class Step:
    """One command of the plan; `limit_s` is both its time limit and what it needs to start."""

    name: str
    argv: tuple[str, ...]
    limit_s: float
    writes_json: bool = True  # the command takes `--out FILE` (appended) and writes its result


@dataclass
class Outcome:
    name: str
    status: str  # ok, failed, timed_out or skipped
    seconds: float = 0.0
    rc: int | None = None
    reason: str = ""
    result: Any = None
    stdout_tail: str = ""


@dataclass(frozen=True)
class Ran:
    """What running one step gave: its exit status (None when it ran out of time) and stdout."""

    rc: int | None
    stdout: str = ""
    result: Any = None


Runner = Callable[[Step, float], Ran]


def run_steps(steps: Sequence[Step], budget_s: float, runner: Runner,
              clock: Callable[[], float] = time.monotonic,
              report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Run `steps` in order within `budget_s` seconds of `clock`; a step whose limit exceeds
    the time left is skipped (with the reason) and the next one is considered."""
    started = clock()
    outcomes = []
    for step in steps:
        left = budget_s - (clock() - started)
        if step.limit_s > left:
            outcome = Outcome(step.name, "skipped", reason=f"needs up to {step.limit_s:.0f} s, "
                              f"{max(0.0, left):.0f} s left before the deadline")
        else:
            began = clock()
            ran = runner(step, step.limit_s)
            if ran.rc is None:
                status, reason = "timed_out", f"over its limit of {step.limit_s:.0f} s"
            elif ran.rc != 0:
                status, reason = "failed", f"exit status {ran.rc}"
            else:
                status, reason = "ok", ""
            outcome = Outcome(step.name, status, round(clock() - began, 1), ran.rc, reason,
                              ran.result, ran.stdout[-STDOUT_TAIL_CHARS:])
        outcomes.append(outcome)
        report(outcome)
    return outcomes


def _dig(document: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(document, Mapping) or key not in document:
            return None
        document = document[key]
    return document


def summarise(outcomes: Sequence[Outcome], date: str, commit: str) -> dict[str, Any]:
    """The summary's fields, from the results of the steps that succeeded; None for the rest
    (a failed step's numbers are not reported: it may have failed for measuring the wrong
    thing, e.g. eager under the name of graphs)."""
    results = {o.name: o.result for o in outcomes if o.status == "ok"}
    summary: dict[str, Any] = {"date": date, "commit": commit}
    for name, (step, path, convert) in SOURCES.items():
        value = _dig(results.get(step), path)
        summary[name] = convert(value) if (convert and value is not None) else value
    return {name: summary[name] for name in SUMMARY_FIELDS}


def summary_name(date: str) -> str:
    return f"h200-{date}-summary.json"


def plan(*, dry_run: bool, python: str = sys.executable,
         fixtures: Path = FIXTURES) -> list[Step]:
    """The steps of one GPU run, most important first. With `dry_run`, each script runs in its
    `--quick` mode (CPU, small shapes), the flags after it kept but overridden where quick
    mode sets them."""
    quick = ("--quick",) if dry_run else ()
    scale = DRY_RUN_SCALE if dry_run else 1.0
    http = (python, "bench/bench_gpu_http.py", *quick, "--gdn-prefill", "fla")
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    return [
        # Latency by length, fresh lengths, cold warm-up, graph memory, C1/C16/C32, over HTTP.
        Step("http_graphs_cold", (*http, "--cuda-graphs", "on"), 240 * scale),
        # Golden parity in bf16, eager and graphs, and graphs vs eager question by question.
        Step("parity_bf16", (python, "bench/gpu_parity.py", *quick, "--fixtures", str(fixtures),
                             "--device", "cuda", "--dtype", "bfloat16", "--gdn-prefill", "fla",
                             "--cuda-graphs", "both"), 120 * scale),
        # Start-up again with the kernel cache the first step left.
        Step("warmup_cached", (*http, "--cuda-graphs", "on", "--warmup-only"), 60 * scale),
        # Two workers on one GPU: warm-up, memory, C16/C32.
        Step("two_workers", (*http, "--cuda-graphs", "on", "--workers-per-device", "2",
                             "--lengths", "--fresh", "0", "--concurrency", "16", "32"),
             120 * scale),
        # Eager over HTTP by length, beside graphs (the latency-by-length comparison).
        Step("http_eager", (*http, "--cuda-graphs", "off", "--lengths", "150", "370", "1000",
                            "2000", "7000", "16000", "--fresh", "0", "--concurrency", "1", "16",
                            "32"), 120 * scale),
        # Device idle share, launches per request and top kernels, eager vs graphs.
        Step("profile", (python, "bench/bench_gpu_profile.py", *quick, "--gdn-prefill", "fla",
                         "--modes", "eager", "graphs"), 90 * scale),
        # The capture unit tests and fla's short convolution (they skip without CUDA).
        Step("graphs_unit", (*pytest, "tests/test_graphs.py", "-k", "cuda"), 60 * scale,
             writes_json=False),
        Step("short_conv_unit", (*pytest, "tests/test_short_conv_cuda.py"), 45 * scale,
             writes_json=False),
    ]


class SubprocessRunner:
    """Runs a step from the repository root in its own process group (a timed-out step's
    server and workers go with it), stderr appended to one log, `--out` in `scratch`."""

    def __init__(self, scratch: Path, log: Path, env: Mapping[str, str]) -> None:
        self.scratch = scratch
        self.log = log
        self.env = dict(env)

    def __call__(self, step: Step, limit_s: float) -> Ran:
        out = self.scratch / f"{step.name}.json"
        out.unlink(missing_ok=True)  # a result left by an earlier run is not this one's
        argv = [*step.argv, "--out", str(out)] if step.writes_json else list(step.argv)
        with self.log.open("a", encoding="utf-8") as log:
            log.write(f"=== {step.name}: {' '.join(argv)}\n")
            log.flush()
            process = subprocess.Popen(argv, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=log, text=True,
                                       errors="replace", start_new_session=True)
            try:
                stdout, _ = process.communicate(timeout=limit_s)
                rc: int | None = process.returncode
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, _ = process.communicate()
                rc = None
        result = None
        if out.is_file():
            try:
                result = json.loads(out.read_text(encoding="utf-8"))
            except ValueError:
                result = None
        return Ran(rc, stdout or "", result)


def commit_id() -> str:
    """The commit measured: git's HEAD where the checkout has its history, else the one
    `bench/gpu_prepare.sh` recorded in .gpu/COMMIT, else "unknown"."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=False, timeout=10)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except OSError:
        pass
    recorded = REPO / ".gpu" / "COMMIT"
    return recorded.read_text().strip() if recorded.is_file() else "unknown"


def _trim(path: Path, keep: int) -> None:
    if path.is_file() and path.stat().st_size > keep:
        data = path.read_bytes()[-keep:]
        path.write_bytes(b"[... cut ...]\n" + data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchlib.gpu_steps",
                                     description="Run the GPU steps under one deadline.")
    parser.add_argument("--dry-run", action="store_true",
                        help="every step in its script's --quick mode (CPU)")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds from now by which everything, summary included, is done")
    parser.add_argument("--out", type=Path, required=True, help="where the files go")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/clef-gpu-steps"))
    parser.add_argument("--only", nargs="*", help="run just these steps (in plan order)")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    steps = plan(dry_run=args.dry_run, fixtures=args.fixtures)
    if args.only:
        steps = [step for step in steps if step.name in args.only]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # One kernel cache for every step, empty at the start: the first step's warm-up is the
    # cold figure, `warmup_cached` the warm one.
    cache = args.scratch / "triton-cache"
    cache.mkdir(exist_ok=True)
    env.setdefault("TRITON_CACHE_DIR", str(cache))
    log = args.out / "logs.txt"
    steps_file = args.out / "steps.jsonl"
    steps_file.write_text("")

    def report(outcome: Outcome) -> None:
        with steps_file.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(outcome)) + "\n")
        print(f"{outcome.status:<9} {outcome.name:<18} {outcome.seconds:6.1f} s  "
              f"{outcome.reason}", flush=True)

    outcomes = run_steps(steps, args.deadline - RESERVE_S, SubprocessRunner(args.scratch, log, env),
                         report=report)
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    summary = summarise(outcomes, date, commit_id())
    (args.out / summary_name(date)).write_text(json.dumps(summary, indent=1) + "\n")
    _trim(log, LOG_TAIL_BYTES)
    print(json.dumps(summary, indent=1))
    failed = [o.name for o in outcomes if o.status in ("failed", "timed_out")]
    skipped = [o.name for o in outcomes if o.status == "skipped"]
    print(f"=== {len(outcomes) - len(failed) - len(skipped)} ok, {len(failed)} failed "
          f"{failed}, {len(skipped)} skipped {skipped}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

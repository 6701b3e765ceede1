"""The GPU script's steps under one deadline, and the summary it leaves behind.

On a GPU host the whole check is one command of at most 10 minutes (`bench/gpu_session.sh`,
default deadline 560 s, its own setup included; the device call gives it 600 s). Steps run one
at a time in priority order, each
under its own time limit; a step whose limit does not fit in the time left is not started but
skipped, and reported as such, so the most important numbers always come first and the command
always ends inside its deadline. The first step pays the cold kernel compilation (Triton and
fla autotuning with an empty cache, unless an earlier sitting's archive for this GPU, Triton and
torch seeded it), so it has the largest limit; later steps share its cache.

The plan fits: the required steps' limits add up to at most the deadline less the setup
allowance and the reserve (`plan_fits`, checked by the dry run and the tests), so every required
step runs even if each one takes its whole limit; the optional steps after them run only in
the time left. When the first step finds that CUDA graph capture failed, the later steps that
measure graphs are skipped (their numbers would be eager ones under the name of graphs).

What a sitting leaves in `$OUT`, written as it goes, so that a step killed at its limit (or the
whole command killed) still leaves what was measured: `steps.jsonl` (each step's status, time,
exit code, reason and result, appended after each step), `logs.txt` (every step's stderr and,
as it arrives, the stderr of the servers and workers the steps start: `CLEF_BENCH_SERVER_LOG`),
the benches' partial results (they rewrite their `--out` after each phase, and a timed-out
step's partial result counts in the summary), the kernel cache in one archive
(`kernel-cache.tar.gz`: compiled kernels and autotune results, keyed by GPU, Triton and torch,
rewritten after each step: benchlib/kernel_cache_archive.py; a later sitting seeds its cache
from `.gpu/kernel-cache.tar.gz`, or the first sitting's `.gpu/triton-autotune.tar`, when
present and built for its host), and the
summary `h200-YYYY-MM-DD-summary.json` with the fixed fields of `SUMMARY_FIELDS` (null where a
step did not run or failed), which also records the project's own commit, the graph shapes the
H200 defaults plan, and `error` when the sitting could not start (`--error`: missing wheels, a
failed `import fla`; no step runs then, but the summary and gpu_session.sh's `env.txt` are
still written). The device returns at most 8 files, so `$OUT` holds these five and nothing
else: the steps' own results stay in `--scratch`.

Every HTTP figure is a forward: the HTTP benches run their servers with the answer cache off,
and `answer_cache_hits` (summed over their servers' `/metrics`) says so. fla's l2norm kernel,
which autotunes 25 configs for each token-count bucket (~100 compiles of a cold start), gets a
shipped default config (`bench/fla-configs/`, through fla's `FLA_CONFIG_DIR` and
`FLA_CACHE_MODE=default`, unless either is already set); fla's other kernels autotune as usual.

The scheduling (`run_steps`) and the summary (`summarise`) take the clock and the step runner
as arguments, so they are unit-tested without CUDA or subprocesses.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchlib.gpu_targets import judge
from benchlib.kernel_cache_archive import ARCHIVE, archive_cache, cache_key, find_seed, seed_cache
from benchlib.paths import FIXTURES, REPO
from clef_frontend.build_info import git_commit

DEFAULT_DEADLINE_S = 560.0
# A dry run's steps are CPU quick runs on a shared CI machine: same plan and order, limits (and
# the deadline gpu_session.sh gives) scaled by this, so a slow CI host does not fail the check
# of the wiring.
DRY_RUN_SCALE = 2.0
# Kept back from the deadline for writing the summary after the last step.
RESERVE_S = 10.0
# gpu_session.sh's setup before the steps (installing the wheels, nvidia-smi, versions): the
# deadline counts it, so the required steps must fit in what is left after it.
SETUP_ALLOWANCE_S = 30.0
# Where the next sitting's seed is looked for: the launcher copies the newest sitting's
# kernel-cache.tar.gz (or, from the first sitting, triton-autotune.tar) there.
SEED_FOLDERS = (REPO / ".gpu",)
# fla's kernel configs shipped with the project: the l2norm default (see the module docs).
FLA_CONFIGS = REPO / "bench" / "fla-configs"
FLA_CACHE_MODE = "default"  # fla: use a shipped file's default_config, autotune the rest
COMMIT_ENV = "CLEF_COMMIT"  # the launcher's record of the commit measured: it wins
SERVER_LOG_ENV = "CLEF_BENCH_SERVER_LOG"  # benchlib.serve appends the servers' stderr there
LOG_TAIL_BYTES = 8 << 20
STDOUT_TAIL_CHARS = 4000

SUMMARY_FIELDS = (
    "date", "commit", "error", "kernel_cache", "batch_layout", "graph_shapes_planned",
    "graph_shapes_captured", "self_check", "self_check_ms", "self_check_problem", "ready_s",
    "startup", "restart_ready_s", "restart_self_check_ms", "answer_cache_hits",
    "p50_ms_400tok_state", "p50_ms_1000tok_fresh", "p50_ms_7000tok_fresh",
    "replay_ms_7000tok_bucket", "fresh_7000_vs_replay", "fresh_reused_tokens_max",
    "p50_ms_hit_400_on_6600", "hit_reused_tokens_min",
    "kernels_per_forward", "device_ms_by_class", "replay_ms_370tok",
    "device_idle_before_replay_ms", "device_idle_after_replay_ms", "device_idle_fraction",
    "profile_wall_ms_370tok", "kernels_per_forward_400tok_state",
    "device_idle_fraction_400tok_state", "profile_wall_ms_400tok_state",
    "p50_ms_370tok", "p99_ms_370tok", "p99_samples_370tok",
    "fresh_len_max_ratio", "warmup_cold_s", "warmup_cached_s", "c1_rps", "c16_rps", "c32_rps",
    "mixed_c16_rps", "padded_p50_ms_370tok", "padded_p50_ms_1000tok", "padded_c16_rps",
    "padded_mixed_c16_rps", "padded_warmup_s", "padded_graph_shapes_captured",
    "eager_p50_ms_370tok", "eager_c16_rps", "two_workers_c16_rps", "graph_memory_bytes",
    "parity_dtype", "bf16_eager_vs_fp32_max_prob_diff", "bf16_graphs_vs_fp32_max_prob_diff",
    "bf16_argmax_mismatches", "bf16_graphs_vs_eager_max_prob_diff", "argmax_equal",
    "packed_graphs_vs_packed_eager_max_prob_diff", "packed_groups_argmax_equal",
    "packed_at_padded_settings_p50_ms_370tok", "packed_at_padded_settings_c16_rps",
    "packed_at_padded_settings_mixed_c16_rps",
    "prefix_agent_loop_speedup", "prefix_fan_out_speedup", "prefix_unrelated_speedup",
    "prefix_agent_loop_max_abs_diff", "targets",
)
# Fields the script computes itself, not read from one step's result (`kernel_cache`: what
# seeded the cache and what the archive left for the next sitting holds).
OWN_FIELDS = ("date", "commit", "error", "kernel_cache", "graph_shapes_planned",
              "answer_cache_hits", "self_check_problem", "targets")
# Fields read from a step even when it failed: what the worker's start-up reported (its
# self-check with each probe's figures, how long it took, the time to ready) is true whatever
# went wrong after it, and is what a failure is diagnosed from.
KEPT_ON_FAILURE = ("self_check", "self_check_ms", "ready_s", "startup")
# Step fields a dry run leaves null by design: its quick HTTP steps stay within 512 tokens (no
# 1,000- or 7,000-token state), and on CPU the profile has no device timeline. The start-up
# phases are null until the worker reports them in /health (read by key, wherever it puts
# them). Every other field read from a step that ran must come back filled (`unfilled`), so a
# bench whose result keys drift fails the dry run in CI, not the one GPU sitting.
DRY_RUN_NULL_FIELDS = ("p50_ms_1000tok_fresh", "p50_ms_7000tok_fresh", "padded_p50_ms_1000tok",
                       "replay_ms_7000tok_bucket", "fresh_7000_vs_replay",
                       "kernels_per_forward", "device_ms_by_class", "replay_ms_370tok",
                       "device_idle_before_replay_ms", "device_idle_after_replay_ms",
                       "device_idle_fraction", "kernels_per_forward_400tok_state",
                       "device_idle_fraction_400tok_state", "startup")
# The steps whose servers' answer-cache hits are summed (every step that times HTTP).
HTTP_STEPS = ("http_graphs_cold", "http_padded", "warmup_cached", "http_eager", "two_workers",
              "http_packed_at_padded_settings")


def _ms_to_s(value: Any) -> float:
    return round(float(value) / 1000.0, 2)


# field: (step, path into that step's JSON result, conversion)
def _count(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


SOURCES: dict[str, tuple[str, tuple[str, ...], Callable[[Any], Any] | None]] = {
    "batch_layout": ("http_graphs_cold", ("capture", "batch_layout"), None),
    "graph_shapes_captured": ("http_graphs_cold", ("capture", "captured_shapes"), _count),
    "padded_p50_ms_370tok": ("http_padded", ("latency", "370", "p50_ms"), None),
    "padded_p50_ms_1000tok": ("http_padded", ("latency", "1000", "p50_ms"), None),
    "padded_c16_rps": ("http_padded", ("throughput", "C16", "req_per_s"), None),
    "padded_warmup_s": ("http_padded", ("warmup_ms",), _ms_to_s),
    "padded_graph_shapes_captured": ("http_padded", ("capture", "captured_shapes"), _count),
    "eager_p50_ms_370tok": ("http_eager", ("latency", "370", "p50_ms"), None),
    "eager_c16_rps": ("http_eager", ("throughput", "C16", "req_per_s"), None),
    "packed_groups_argmax_equal": ("parity_bf16", ("packed_groups_argmax_equal",), None),
    "p50_ms_370tok": ("http_graphs_cold", ("latency", "370", "p50_ms"), None),
    "p99_ms_370tok": ("http_graphs_cold", ("latency", "370", "p99_ms"), None),
    "p99_samples_370tok": ("http_graphs_cold", ("latency", "370", "n"), None),
    "self_check": ("http_graphs_cold", ("self_check",), None),
    "self_check_ms": ("http_graphs_cold", ("self_check_ms",), None),
    "ready_s": ("http_graphs_cold", ("ready_s",), None),
    "packed_at_padded_settings_p50_ms_370tok": (
        "http_packed_at_padded_settings", ("latency", "370", "p50_ms"), None),
    "packed_at_padded_settings_c16_rps": (
        "http_packed_at_padded_settings", ("throughput", "C16", "req_per_s"), None),
    "packed_at_padded_settings_mixed_c16_rps": (
        "http_packed_at_padded_settings", ("mixed_throughput", "C16", "req_per_s"), None),
    "mixed_c16_rps": ("http_graphs_cold", ("mixed_throughput", "C16", "req_per_s"), None),
    "padded_mixed_c16_rps": ("http_padded", ("mixed_throughput", "C16", "req_per_s"), None),
    # The dtype the parity step ran in: bfloat16 on the GPU; a dry run's quick mode fills the
    # bf16_* fields from float32 on the CPU, and says so here.
    "parity_dtype": ("parity_bf16", ("dtype",), None),
    "bf16_eager_vs_fp32_max_prob_diff": (
        "parity_bf16", ("modes", "off", "max_abs_probability_diff"), None),
    "bf16_graphs_vs_fp32_max_prob_diff": (
        "parity_bf16", ("modes", "on", "max_abs_probability_diff"), None),
    "bf16_argmax_mismatches": ("parity_bf16", ("argmax_mismatches_vs_golden",), None),
    "packed_graphs_vs_packed_eager_max_prob_diff": (
        "parity_bf16", ("packed_graphs_vs_packed_eager", "max_abs_probability_diff"), None),
    # What users send: distinct states >= 256 tokens, each a fresh forward that stores its
    # points and can reuse none (bench_gpu_http.py's fresh-state phase), the longest set
    # against the replay of the graph bucket that holds it.
    "p50_ms_400tok_state": ("http_graphs_cold", ("state_latency", "400", "p50_ms"), None),
    "p50_ms_1000tok_fresh": ("http_graphs_cold", ("state_latency", "1000", "p50_ms"), None),
    "p50_ms_7000tok_fresh": ("http_graphs_cold", ("state_latency", "7000", "p50_ms"), None),
    "replay_ms_7000tok_bucket": (
        "http_graphs_cold", ("state_latency", "7000", "bucket_replay_ms"), None),
    "fresh_7000_vs_replay": (
        "http_graphs_cold", ("state_latency", "7000", "vs_bucket_replay"), None),
    "fresh_reused_tokens_max": (
        "http_graphs_cold", ("state_latency", "400", "reused_tokens_max"), None),
    # A stored 6,600-token state, then requests adding ~400 new tokens each after it.
    "p50_ms_hit_400_on_6600": ("http_graphs_cold", ("prefix_hit", "p50_ms"), None),
    "hit_reused_tokens_min": ("http_graphs_cold", ("prefix_hit", "reused_tokens_min"), None),
    # Start-up: the worker's phases as /health reports them, and a worker killed and restarted.
    "startup": ("http_graphs_cold", ("startup",), None),
    "restart_ready_s": ("http_graphs_cold", ("restart", "ready_s"), None),
    "restart_self_check_ms": ("http_graphs_cold", ("restart", "self_check_ms"), None),
    # The profile of one short request through its graph (bench_gpu_profile.py).
    "kernels_per_forward": ("profile", ("modes", "graphs", "kernels_per_forward"), None),
    "device_ms_by_class": ("profile", ("modes", "graphs", "device_ms_by_class"), None),
    "replay_ms_370tok": ("profile", ("modes", "graphs", "replay", "replay_ms"), None),
    "device_idle_before_replay_ms": (
        "profile", ("modes", "graphs", "replay", "idle_before_ms"), None),
    "device_idle_after_replay_ms": (
        "profile", ("modes", "graphs", "replay", "idle_after_ms"), None),
    "device_idle_fraction": ("profile", ("modes", "graphs", "device_idle_fraction"), None),
    "profile_wall_ms_370tok": ("profile", ("modes", "graphs", "wall_ms_per_request"), None),
    # The same profile over distinct ~400-token states that store their points (the path a
    # user's fresh request takes).
    "kernels_per_forward_400tok_state": (
        "profile", ("modes", "graphs", "state", "kernels_per_forward"), None),
    "device_idle_fraction_400tok_state": (
        "profile", ("modes", "graphs", "state", "device_idle_fraction"), None),
    "profile_wall_ms_400tok_state": (
        "profile", ("modes", "graphs", "state", "wall_ms_per_request"), None),
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
    # The prefix cache at Clef-Flash's shapes: worker time off over on after the first turn
    # (the median of each request's pair), and the largest answer difference on against off.
    "prefix_agent_loop_speedup": (
        "prefix_cache", ("workloads", "agent_loop", "paired_speedup_after_first"), None),
    "prefix_fan_out_speedup": (
        "prefix_cache", ("workloads", "fan_out", "paired_speedup_after_first"), None),
    "prefix_unrelated_speedup": (
        "prefix_cache", ("workloads", "unrelated", "paired_speedup_after_first"), None),
    "prefix_agent_loop_max_abs_diff": (
        "prefix_cache", ("workloads", "agent_loop", "max_abs_diff"), None),
}


@dataclass(frozen=True)
class Step:
    """One command of the plan; `limit_s` is both its time limit and what it needs to start."""

    name: str
    argv: tuple[str, ...]
    limit_s: float
    writes_json: bool = True  # the command takes `--out FILE` (appended) and writes its result
    graphs: bool = False  # it measures CUDA graphs: skipped once capture is known to fail
    optional: bool = False  # runs only in the time the required steps leave (not in the fit)
    # For a graphs step that also measures something without graphs: the command run instead
    # of skipping once capture is known to fail (the eager half keeps its figures, so kernels
    # and capture are still told apart).
    without_graphs: tuple[str, ...] | None = None
    # A pytest run that fails unless more than zero tests passed and none was skipped (a
    # CUDA test file whose every test skips would otherwise pass on a host without CUDA).
    tests_must_run: bool = False


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


def capture_failed(outcome: Outcome) -> bool:
    """Whether a graphs step's result says CUDA graph capture failed (a bench exits 1 with its
    `capture_problems` when graphs were asked for and not all were captured). Graphs dropped
    by a self-check fallback are not a capture failure: that is `self_check_problem`."""
    result = outcome.result
    return (isinstance(result, Mapping) and bool(result.get("capture_problems"))
            and not _dig(result, ("self_check", "fell_back_from")))


def self_check_problem(result: Any) -> str:
    """What a step's worker self-check reported wrong: a disagreement (with the failing probes
    and figures) or a fallback; "" when it passed on the layout asked for or reported none."""
    verdict = _dig(result, ("self_check",))
    if not isinstance(verdict, Mapping):
        return ""
    fell_back = verdict.get("fell_back_from") or []
    failing = [probe.get("name") for probe in verdict.get("probes") or ()
               if isinstance(probe, Mapping) and not probe.get("passed", True)]
    if fell_back:
        return (f"self-check fell back from {', '.join(map(str, fell_back))} to "
                f"{verdict.get('layout')} (the serving layout disagreed with the eager answers)")
    if verdict.get("passed") is False:
        return (f"self-check disagreed on {verdict.get('layout')}: max |dp| "
                f"{verdict.get('max_abs_diff')} (bound {verdict.get('bound')}), probes "
                f"{failing}")
    return ""


def self_check_problems(outcomes: Sequence[Outcome]) -> str | None:
    """Each step's self-check problem, `step: problem`, joined; None when there is none."""
    problems = [f"{o.name}: {problem}" for o in outcomes
                if (problem := self_check_problem(o.result))]
    return "; ".join(problems) or None


TEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def unproven_tests(stdout: str) -> str:
    """Why a pytest step that exited 0 still proves nothing: no test passed, or some were
    skipped (on the GPU every one of its CUDA tests must run); "" when it proves something."""
    lines = [line for line in stdout.strip().splitlines() if TEST_COUNTS.search(line)]
    counts: dict[str, int] = {}
    for number, kind in TEST_COUNTS.findall(lines[-1] if lines else ""):
        counts[kind] = counts.get(kind, 0) + int(number)
    if counts.get("passed", 0) == 0:
        return "no test passed"
    if counts.get("skipped", 0):
        return f"{counts['skipped']} tests skipped (every CUDA test must run on the GPU)"
    return ""


def run_steps(steps: Sequence[Step], budget_s: float, runner: Runner,
              clock: Callable[[], float] = time.monotonic,
              report: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Run `steps` in order within `budget_s` seconds of `clock`; a step whose limit exceeds
    the time left is skipped (with the reason) and the next one is considered; once a step
    says capture failed, the later graphs steps are skipped, or run as their `without_graphs`
    command where they have one."""
    started = clock()
    outcomes: list[Outcome] = []
    no_graphs = ""
    for step in steps:
        left = budget_s - (clock() - started)
        note = ""
        if step.graphs and no_graphs and step.without_graphs is not None:  # run it, eager
            step = dataclasses.replace(step, argv=step.without_graphs, graphs=False)
            note = f"run without graphs: CUDA graph capture failed in {no_graphs}"
        if step.graphs and no_graphs:  # a graphs step with no eager command
            outcome = Outcome(step.name, "skipped", reason=f"CUDA graph capture failed in "
                              f"{no_graphs}")
        elif step.limit_s > left:
            outcome = Outcome(step.name, "skipped", reason=f"needs up to {step.limit_s:.0f} s, "
                              f"{max(0.0, left):.0f} s left before the deadline")
        else:
            began = clock()
            ran = runner(step, step.limit_s)
            if ran.rc is None:
                status, reason = "timed_out", f"over its limit of {step.limit_s:.0f} s"
            elif ran.rc != 0:
                status, reason = "failed", f"exit status {ran.rc}"
            elif step.tests_must_run and (problem := unproven_tests(ran.stdout)):
                status, reason = "failed", problem
            else:
                status, reason = "ok", ""
            checked = self_check_problem(ran.result)
            reason = "; ".join(part for part in (note, reason, checked) if part)
            outcome = Outcome(step.name, status, round(clock() - began, 1), ran.rc, reason,
                              ran.result, ran.stdout[-STDOUT_TAIL_CHARS:])
            if step.graphs and capture_failed(outcome):
                no_graphs = step.name
        outcomes.append(outcome)
        report(outcome)
    return outcomes


def _dig(document: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(document, Mapping) or key not in document:
            return None
        document = document[key]
    return document


def answer_cache_hits(results: Mapping[str, Any]) -> int | None:
    """The answer-cache hits the HTTP steps' servers counted, summed (None when none said)."""
    counts = [_dig(results.get(step), ("answer_cache_hits",)) for step in HTTP_STEPS]
    known = [int(count) for count in counts if count is not None]
    return sum(known) if known else None


def summarise(outcomes: Sequence[Outcome], date: str, commit: str,
              graph_shapes_planned: int | None = None, error: str | None = None,
              kernel_cache: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The summary's fields, from the results of the steps that succeeded or ran out of time
    (what a timed-out step measured before its limit stands: the benches write their results
    after each phase); None for the rest (a failed step's numbers are not reported: it may
    have failed for measuring the wrong thing, e.g. eager under the name of graphs). `error`:
    why the sitting could not run (None when it could). The start-up fields of
    `KEPT_ON_FAILURE` are read from a failed step too; `self_check_problem` says which step's
    self-check disagreed or fell back (None: none did)."""
    results = {o.name: o.result for o in outcomes if o.status in ("ok", "timed_out")}
    every = {o.name: o.result for o in outcomes if o.result is not None}
    summary: dict[str, Any] = {"date": date, "commit": commit, "error": error,
                               "kernel_cache": None if kernel_cache is None else dict(kernel_cache),
                               "graph_shapes_planned": graph_shapes_planned,
                               "answer_cache_hits": answer_cache_hits(results),
                               "self_check_problem": self_check_problems(outcomes)}
    for name, (step, path, convert) in SOURCES.items():
        value = _dig((every if name in KEPT_ON_FAILURE else results).get(step), path)
        summary[name] = convert(value) if (convert and value is not None) else value
    summary["targets"] = judge(summary)
    return {name: summary[name] for name in SUMMARY_FIELDS}


def unfilled(summary: Mapping[str, Any], outcomes: Sequence[Outcome],
             allowed: Sequence[str] = DRY_RUN_NULL_FIELDS) -> list[str]:
    """The summary's null fields whose step ran to the end (`ok`) and that may not be null:
    the step's result lacks the key the summary reads."""
    ran = {o.name for o in outcomes if o.status == "ok"}
    return [name for name, (step, _, _) in SOURCES.items()
            if summary.get(name) is None and step in ran and name not in allowed]


def summary_name(date: str) -> str:
    return f"h200-{date}-summary.json"


def plan(*, dry_run: bool, python: str = sys.executable,
         fixtures: Path = FIXTURES) -> list[Step]:
    """The steps of one GPU run, most important first. With `dry_run`, each script runs in its
    `--quick` mode (CPU, small shapes), the flags after it kept but overridden where quick
    mode sets them.

    The order follows what the last sitting (2026-12-04) could not measure: its latency
    phases timed prefix hits (one body repeated, the cache on) and its profile, prefix and
    eager steps never ran (31 s left). So the required steps are now what users send (the
    first step's fresh states, prefix hits and distinct-state throughput), the profile and
    the prefix cache on against off; the steps that ran last time come after those that did
    not, in the time left.

    Limits, from the last sitting's measured times where a step ran then. The first step:
    135.8 s to ready cold (load 17 s, capture 52 s, self-check 63 s), then fresh states at
    400 / 1,000 / 7,000 tokens (~60 requests, ~10 s), 17 prefix hits (~3 s), C1/C16/C32 and
    the mixed C16 for 5 s each (~20 s), four fresh lengths four times (~5 s), 300 requests at
    370 tokens (~8 s) and the worker killed and restarted with the kernel cache warm (36.6 s
    to ready then): ~225 s, so 250 s; its last phase is the restart, so a time-out loses the
    least. The profile: the model built in memory, the graphs up to 2,048 tokens captured
    from the cache the first step left, 30 requests profiled (~40-60 s on paper), so 80 s.
    The prefix step: two servers on the warm cache (~37 s each), 29 requests on each, the
    long ones eager while the cached path is (~15 s): ~100 s, so the rest of the 520 s the
    required steps may take, 190 s. The parity step took
    88 s of its 125, the padded step 72 of 105, `warmup_cached` 47 of 50, packed at the
    padded settings 58 of 60, `packed_unit` 39 of 60. Every HTTP server checks itself with
    `--self-check report` (bench_gpu_http.py): recorded, never a fallback. The pytest steps
    fail on the GPU unless a test passed and none was skipped."""
    quick = ("--quick",) if dry_run else ()
    scale = DRY_RUN_SCALE if dry_run else 1.0
    http = (python, "bench/bench_gpu_http.py", *quick, "--gdn-prefill", "fla")
    # The HTTP steps after the first one measure their own setting, not users' traffic again:
    # no fresh-state lengths, no prefix hits, no restart.
    http_other = (*http, "--state-lengths", "--hit", "0", "0", "--restart", "off")
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider")
    # The padded step's settings (and the packed step compared with it at the same ones).
    small_settings = ("--max-length", "1024", "--max-batch-tokens", "6144", "--repeat", "30",
                      "--p99-samples", "0", "--fresh", "0", "--concurrency", "16", "--seconds",
                      "6", "--mixed-concurrency", "16")
    parity = (python, "bench/gpu_parity.py", *quick, "--fixtures", str(fixtures), "--device",
              "cuda", "--dtype", "bfloat16", "--gdn-prefill", "fla")
    return [
        # Packed (the default), what users send: cold start-up and its phases, fresh states
        # by length, prefix hits, distinct-state throughput at C1/C16/C32 and mixed lengths
        # at C16, fresh lengths, the short repeated body (p99 from 300 samples), and a worker
        # killed and restarted.
        Step("http_graphs_cold", (*http, "--cuda-graphs", "on", "--repeat", "30",
                                  "--p99-samples", "300", "--fresh", "4", "--seconds", "5",
                                  "--mixed-concurrency", "16"), 250 * scale, graphs=True),
        # Where a short request's time goes on the device: kernels per forward, device time
        # by class, idle before and after the replay (graphs only: eager compiles the
        # fixed-length kernels anew, and `http_eager` covers eager).
        Step("profile", (python, "bench/bench_gpu_profile.py", *quick, "--gdn-prefill", "fla",
                         "--modes", "graphs", "--requests", "30"), 80 * scale, graphs=True),
        # The prefix cache on the real shapes (random weights, bf16): the agent loop, the
        # fan-out and unrelated states, the cache on against --prefix-cache off, two servers
        # (bench/bench_prefix_cache.py), answers within the self-check's bf16 bound.
        Step("prefix_cache", (python, "bench/bench_prefix_cache.py", *quick, "--device", "cuda",
                              "--dtype", "bfloat16", "--shape", "flash", "--tolerance", "1e-2",
                              "--agent", "2400", "6000", "300", "--fan-out", "7000", "8",
                              "--unrelated", "8", "2000"), 190 * scale),
        # Optional, in the time left. First the bf16 parity, since the kernels change between
        # sittings (answers before speed): bf16 eager and graphs against the float32 goldens,
        # graphs vs eager question by question, packed groups against alone. Once capture is
        # known to fail it runs eager alone: the kernels' bf16 figures still come back.
        Step("parity_bf16", (*parity, "--cuda-graphs", "both"), 125 * scale, graphs=True,
             without_graphs=(*parity, "--cuda-graphs", "off"), optional=True),
        # Then the steps that never ran: the other CUDA-only unit tests, eager over HTTP,
        # two workers, fine-tuned variants.
        Step("graphs_unit", (*pytest, "tests/test_graphs.py", "-k", "cuda"), 45 * scale,
             writes_json=False, graphs=True, optional=True, tests_must_run=not dry_run),
        Step("short_conv_unit", (*pytest, "tests/test_short_conv_cuda.py"), 40 * scale,
             writes_json=False, optional=True, tests_must_run=not dry_run),
        Step("http_eager", (*http_other, "--cuda-graphs", "off", "--lengths", "370",
                            "--repeat", "20", "--p99-samples", "0", "--fresh", "0",
                            "--concurrency", "16", "--seconds", "6", "--mixed-concurrency"),
             60 * scale, optional=True),
        Step("two_workers", (*http_other, "--cuda-graphs", "on", "--workers-per-device", "2",
                             "--lengths", "--fresh", "0", "--concurrency", "16", "32",
                             "--mixed-concurrency"),
             120 * scale, graphs=True, optional=True),
        # Fine-tuned variants' cost at Clef-Flash shapes: a forward of the base alone, with
        # variants loaded, all one variant and mixed (rank 64, as clef-finetune's default), and
        # the memory each variant adds (bench/bench_finetune.py, eager).
        Step("finetune", (python, "bench/bench_finetune.py", *quick, "--device", "cuda",
                          "--shape", "flash", "--gdn-prefill", "fla", "--rank", "64",
                          "--variants", "2", "--group", "16", "--rounds", "5"),
             120 * scale, optional=True),
        # Then those that ran last time: the packed CUDA tests (fla's varlen kernels and
        # varlen_attn on the tiny snapshot in bf16, the prefix cache's CUDA tests; run even
        # when capture failed: most capture nothing, and they place a fault), the padded
        # layout (p50 at 370 / 1,000 tokens, C16, mixed C16, its warm-up), start-up with the
        # kernel cache warm, and packed at the padded step's budget and maximum length.
        Step("packed_unit", (*pytest, "tests/test_packed_cuda.py",
                             "tests/test_packed_runner.py", "tests/test_prefix_cache_cuda.py",
                             "-k", "cuda"),
             60 * scale, writes_json=False, optional=True, tests_must_run=not dry_run),
        Step("http_padded", (*http_other, "--cuda-graphs", "on", "--batch-layout", "padded",
                             *small_settings, "--lengths", "370", "1000"), 105 * scale,
             graphs=True, optional=True),
        Step("warmup_cached", (*http_other, "--cuda-graphs", "on", "--warmup-only"),
             50 * scale, graphs=True, optional=True),
        Step("http_packed_at_padded_settings",
             (*http_other, "--cuda-graphs", "on", "--batch-layout", "packed", *small_settings,
              "--lengths", "370"), 60 * scale, graphs=True, optional=True),
    ]


def failing_steps(outcomes: Sequence[Outcome], steps: Sequence[Step], *,
                  dry_run: bool) -> list[str]:
    """The steps that make the run exit 1: every failure, and every step past its limit except
    an optional one in a dry run. On a CPU host a dry run checks that each script runs and the
    summary fills; how long an optional step's CPU stand-in takes depends on what else the host
    runs (the profile, optional then, once took 119 s of its 180 on a loaded 2-core host and
    9 s on a quiet one), which says nothing about the code. A required step's time-out counts
    in a dry run too: its doubled limit is the wiring check's bound. On the GPU every time-out
    counts."""
    optional = {step.name for step in steps if step.optional}
    return [o.name for o in outcomes
            if o.status == "failed"
            or (o.status == "timed_out" and not (dry_run and o.name in optional))]


def plan_seconds(steps: Sequence[Step]) -> float:
    """What the required steps may take together, each to its limit."""
    return sum(step.limit_s for step in steps if not step.optional)


def plan_fits(steps: Sequence[Step], deadline_s: float) -> bool:
    """Whether every required step runs even if each takes its whole limit."""
    return plan_seconds(steps) <= deadline_s - SETUP_ALLOWANCE_S - RESERVE_S


def graph_shapes_planned() -> int | None:
    """The graph shapes a worker at the H200 defaults captures (the default layout, the
    default token budget, requests per forward and `--max-length`), from the worker's own
    planning code; None where it cannot be imported."""
    try:
        from clef_protocol.options import RequestLimits
        from clef_worker.serving.gpu.buckets import BucketTable
        from clef_worker.serving.gpu.graphs import graph_row_counts, plan_shapes
        from clef_worker.serving.gpu.packed_graphs import packed_buckets
        from clef_worker.serving.policy import PACKED, BatchPolicy
    except ImportError:
        return None
    policy = BatchPolicy.resolve("cuda")
    max_length = RequestLimits().max_length
    if policy.layout == PACKED:
        return len(packed_buckets(policy.max_batch_tokens, max_length))
    table = BucketTable.for_budget(max_length)
    return len(plan_shapes(table, policy.max_batch_tokens, graph_row_counts(policy.max_sequences)))


def fla_config_env(env: Mapping[str, str], configs: Path = FLA_CONFIGS) -> dict[str, str]:
    """fla's config variables for the steps: the shipped configs with `FLA_CACHE_MODE=default`
    unless the launcher set either variable (then its choice stands, untouched)."""
    if "FLA_CONFIG_DIR" in env or "FLA_CACHE_MODE" in env:
        return {}
    return {"FLA_CONFIG_DIR": str(configs), "FLA_CACHE_MODE": FLA_CACHE_MODE}


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


def commit_id(repo: Path = REPO, env: Mapping[str, str] | None = None) -> str:
    """The commit measured: `CLEF_COMMIT` when the launcher set it (it knows what it sent);
    else the project's own HEAD where the project is its own git checkout (a worktree counts);
    else the one `bench/gpu_prepare.sh` recorded in .gpu/COMMIT; else "unknown". Never the
    HEAD of a repository that merely contains the project's folder: git run inside an
    untracked copy would report the enclosing repository's commit."""
    launcher = (os.environ if env is None else env).get(COMMIT_ENV, "").strip()
    if launcher:
        return launcher
    own = git_commit(repo)  # the rule `clef-serve --version` follows: HEAD only at the top
    if own:
        return own
    recorded = repo / ".gpu" / "COMMIT"
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
    parser.add_argument("--error", default="",
                        help="why the sitting cannot run (set by gpu_session.sh): no step "
                             "runs, the summary records it")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    steps = plan(dry_run=args.dry_run, fixtures=args.fixtures)
    nominal = DEFAULT_DEADLINE_S * (DRY_RUN_SCALE if args.dry_run else 1.0)
    planned_s, fits = plan_seconds(steps), plan_fits(steps, nominal)
    print(f"=== plan: required steps {planned_s:.0f} s; deadline {nominal:.0f} s less setup "
          f"{SETUP_ALLOWANCE_S:.0f} s and reserve {RESERVE_S:.0f} s: "
          f"{'fits' if fits else 'DOES NOT FIT'}; {args.deadline:.0f} s left now", flush=True)
    if args.only:
        steps = [step for step in steps if step.name in args.only]
    if args.error:
        print(f"=== not running any step: {args.error}", flush=True)
        steps = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    fla_env = fla_config_env(env)
    env.update(fla_env)
    print(f"=== fla configs: {fla_env or 'as the launcher set them'}", flush=True)
    # One kernel cache for every step, seeded from an earlier sitting's archive when it was
    # built for this GPU, Triton and torch (else empty): the first step's start-up is the
    # figure for that cache, `warmup_cached` the one with this sitting's.
    cache = args.scratch / "triton-cache"
    cache.mkdir(exist_ok=True)
    env.setdefault("TRITON_CACHE_DIR", str(cache))
    env.setdefault("FLA_CACHE_RESULTS", "1")
    cache = Path(env["TRITON_CACHE_DIR"])
    key = cache_key()
    seeded = seed_cache(cache, find_seed(SEED_FOLDERS), key)
    print(f"=== kernel cache {cache} for {key}: {seeded}", flush=True)
    kernel_cache: dict[str, Any] = {"key": key, "seed": seeded, "left": None}
    log = args.out / "logs.txt"
    env[SERVER_LOG_ENV] = str(log)
    steps_file = args.out / "steps.jsonl"
    steps_file.write_text("")

    def report(outcome: Outcome) -> None:
        with steps_file.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(asdict(outcome)) + "\n")
        kernel_cache["left"] = archive_cache(cache, args.out / ARCHIVE, key)
        print(f"{outcome.status:<9} {outcome.name:<18} {outcome.seconds:6.1f} s  "
              f"{outcome.reason}", flush=True)

    outcomes = run_steps(steps, args.deadline - RESERVE_S, SubprocessRunner(args.scratch, log, env),
                         report=report)
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    kernel_cache["left"] = archive_cache(cache, args.out / ARCHIVE, key)
    summary = summarise(outcomes, date, commit_id(), graph_shapes_planned(),
                        error=args.error or None, kernel_cache=kernel_cache)
    (args.out / summary_name(date)).write_text(json.dumps(summary, indent=1) + "\n")
    _trim(log, LOG_TAIL_BYTES)
    print(json.dumps(summary, indent=1))
    failed = failing_steps(outcomes, steps, dry_run=args.dry_run)
    # On the GPU a null field is reported as it is; a dry run checks the wiring behind each.
    empty = unfilled(summary, outcomes) if args.dry_run else []
    if empty:
        print(f"=== the dry run left fields null that its steps should fill: {empty}")
    skipped = [o.name for o in outcomes if o.status == "skipped"]
    print(f"=== {len(outcomes) - len(failed) - len(skipped)} ok, {len(failed)} failed "
          f"{failed}, {len(skipped)} skipped {skipped}; kernel cache left in "
          f"{args.out / ARCHIVE}: {kernel_cache['left']} (copy it to .gpu/ to seed the next "
          "sitting)")
    return 1 if failed or empty or not fits or args.error else 0


if __name__ == "__main__":
    sys.exit(main())

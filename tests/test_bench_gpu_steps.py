"""The GPU script's deadline scheduling and summary (benchlib/gpu_steps.py), without CUDA: a fake
clock that the fake steps advance, and canned step results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib.gpu_steps import (
    DEFAULT_DEADLINE_S,
    DRY_RUN_SCALE,
    FLA_CONFIGS,
    OWN_FIELDS,
    SOURCES,
    SUMMARY_FIELDS,
    Outcome,
    Ran,
    Step,
    SubprocessRunner,
    commit_id,
    failing_steps,
    fla_config_env,
    graph_shapes_planned,
    main,
    plan,
    plan_fits,
    run_steps,
    summarise,
    unfilled,
    unproven_tests,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_runner(clock: FakeClock, takes: dict[str, float], rcs: dict[str, int | None]
                ) -> tuple[list[tuple[str, float]], object]:
    calls: list[tuple[str, float]] = []

    def run(step: Step, limit_s: float) -> Ran:
        calls.append((step.name, limit_s))
        clock.now += min(takes.get(step.name, 1.0), limit_s)
        return Ran(rcs.get(step.name, 0), "out", {"step": step.name})

    return calls, run


def steps(*spec: tuple[str, float]) -> list[Step]:
    return [Step(name, ("true",), limit) for name, limit in spec]


def test_steps_run_in_order_and_a_step_that_does_not_fit_is_skipped_not_started() -> None:
    clock = FakeClock()
    calls, run = fake_runner(clock, {"a": 100, "b": 250, "c": 10, "d": 10}, {})
    outcomes = run_steps(steps(("a", 200), ("b", 300), ("c", 150), ("d", 50)), 400,
                         run, clock)  # type: ignore[arg-type]
    # a takes 100 s (300 left); b needs 300: runs, takes 250 (50 left); c needs 150: skipped;
    # d needs 50: exactly fits.
    assert [c[0] for c in calls] == ["a", "b", "d"]
    assert [(o.name, o.status) for o in outcomes] == [
        ("a", "ok"), ("b", "ok"), ("c", "skipped"), ("d", "ok")]
    assert "needs up to 150 s, 50 s left" in outcomes[2].reason
    assert clock.now - 1000.0 <= 400


def test_each_step_runs_under_its_own_limit_and_failures_are_told_apart() -> None:
    clock = FakeClock()
    calls, run = fake_runner(clock, {"slow": 999}, {"bad": 3, "slow": None})
    outcomes = run_steps(steps(("bad", 60), ("slow", 90), ("fine", 30)), 500,
                         run, clock)  # type: ignore[arg-type]
    assert calls == [("bad", 60), ("slow", 90), ("fine", 30)]
    assert [(o.status, o.rc) for o in outcomes] == [("failed", 3), ("timed_out", None),
                                                    ("ok", 0)]
    assert outcomes[1].seconds == 90  # cut at its limit, and the deadline still holds


def test_the_deadline_holds_for_any_durations() -> None:
    """Whatever each step takes (within its limit), the run ends inside the budget."""
    for takes in ([10, 10, 10, 10], [200, 1, 1, 1], [199, 199, 199, 199], [0, 0, 0, 400]):
        clock = FakeClock()
        spec = (("a", 200), ("b", 200), ("c", 100), ("d", 400))
        _, run = fake_runner(clock, dict(zip("abcd", takes, strict=True)), {})
        outcomes = run_steps(steps(*spec), 450, run, clock)  # type: ignore[arg-type]
        assert clock.now - 1000.0 <= 450
        assert any(o.status == "ok" for o in outcomes)


def canned(name: str, status: str, result: object) -> Outcome:
    return Outcome(name, status, result=result)


COLD = {"latency": {"370": {"p50_ms": 18.5, "p99_ms": 22.0, "n": 300}},
        "state_latency": {"400": {"p50_ms": 14.0, "reused_tokens_max": 0},
                          "1000": {"p50_ms": 27.0},
                          "7000": {"p50_ms": 240.0, "bucket_replay_ms": 230.0,
                                   "vs_bucket_replay": 1.04}},
        "prefix_hit": {"p50_ms": 19.0, "reused_tokens_min": 6592},
        "startup": {"phases": {"imports": 8.1, "load": 9.0}},
        "restart": {"ready_s": 9.5, "self_check_ms": 900.0},
        "fresh_max_ratio": 1.3, "warmup_ms": 41234.0,
        "throughput": {"C1": {"req_per_s": 50.1}, "C16": {"req_per_s": 85.0},
                       "C32": {"req_per_s": 95.5}},
        "mixed_throughput": {"lengths": [90, 370], "C16": {"req_per_s": 70.0}},
        "capture": {"graph_memory_bytes": 123456789, "batch_layout": "packed",
                    "captured_shapes": [[1, 64], [1, 128]]},
        "self_check": {"passed": True, "layout": "packed-graphs", "checked": 6,
                       "max_abs_diff": 1e-3, "fell_back_from": None},
        "self_check_ms": 812.4, "ready_s": 131.5,
        "answer_cache_hits": 0}
# bench_gpu_profile.py's result on CUDA, as much of it as the summary reads
PROFILE = {"modes": {"graphs": {
    "kernels_per_forward": 900.0, "device_ms_by_class": {"gemm": 9.0, "norm": 1.0},
    "device_idle_fraction": 0.2, "wall_ms_per_request": 16.0,
    "replay": {"replay_ms": 12.0, "idle_before_ms": 1.5, "idle_after_ms": 3.0},
    "state": {"kernels_per_forward": 2400.0, "device_idle_fraction": 0.5,
              "wall_ms_per_request": 90.0}}}}
# gpu_parity.py's result, as much of it as the summary reads
PARITY = {"dtype": "bfloat16",
          "modes": {"off": {"max_abs_probability_diff": 2.5e-3, "argmax_mismatches": []},
                    "on": {"max_abs_probability_diff": 3.0e-3, "argmax_mismatches": ["c/q1"]}},
          "argmax_mismatches_vs_golden": 1, "packed_groups_argmax_equal": True,
          "graphs_vs_eager": {"max_abs_probability_diff": 1.5e-3, "argmax_equal": True},
          "packed_graphs_vs_packed_eager": {"max_abs_probability_diff": 0.0,
                                            "argmax_equal": True}}


def test_the_summary_has_exactly_the_fields_from_the_steps_that_succeeded() -> None:
    outcomes = [
        canned("http_graphs_cold", "ok", COLD),
        canned("parity_bf16", "ok", PARITY),
        canned("warmup_cached", "ok", {"warmup_ms": 9000.0, "answer_cache_hits": 0}),
        canned("two_workers", "failed", {"throughput": {"C16": {"req_per_s": 120.0}},
                                         "answer_cache_hits": 50}),
        # ran out of time after its latency phase: what it measured stands
        canned("http_padded", "timed_out", {"latency": {"370": {"p50_ms": 25.0}},
                                            "phase": "latency", "answer_cache_hits": 0}),
        canned("profile", "ok", PROFILE),
        canned("prefix_cache", "ok", {"workloads": {
            "agent_loop": {"paired_speedup_after_first": 4.1, "max_abs_diff": 3e-3},
            "fan_out": {"paired_speedup_after_first": 6.2, "max_abs_diff": 1e-3},
            "unrelated": {"paired_speedup_after_first": 0.99, "max_abs_diff": 0.0}}}),
    ]
    cache = {"key": {"gpu": "NVIDIA H200"}, "seed": {"seeded": 3}, "left": {"complete": True}}
    summary = summarise(outcomes, "2026-12-01", "abc123", 28, kernel_cache=cache)
    assert tuple(summary) == SUMMARY_FIELDS
    assert summary == {
        "date": "2026-12-01", "commit": "abc123", "error": None, "kernel_cache": cache,
        "batch_layout": "packed",
        "graph_shapes_planned": 28, "graph_shapes_captured": 2,
        "self_check": COLD["self_check"], "self_check_ms": 812.4, "self_check_problem": None,
        "ready_s": 131.5, "startup": {"phases": {"imports": 8.1, "load": 9.0}},
        "restart_ready_s": 9.5, "restart_self_check_ms": 900.0,
        "p50_ms_400tok_state": 14.0, "p50_ms_1000tok_fresh": 27.0,
        "p50_ms_7000tok_fresh": 240.0, "replay_ms_7000tok_bucket": 230.0,
        "fresh_7000_vs_replay": 1.04, "fresh_reused_tokens_max": 0,
        "p50_ms_hit_400_on_6600": 19.0, "hit_reused_tokens_min": 6592,
        "kernels_per_forward": 900.0, "device_ms_by_class": {"gemm": 9.0, "norm": 1.0},
        "replay_ms_370tok": 12.0, "device_idle_before_replay_ms": 1.5,
        "device_idle_after_replay_ms": 3.0, "device_idle_fraction": 0.2,
        "profile_wall_ms_370tok": 16.0, "kernels_per_forward_400tok_state": 2400.0,
        "device_idle_fraction_400tok_state": 0.5, "profile_wall_ms_400tok_state": 90.0,
        "answer_cache_hits": 0,  # the failed step's servers are not counted either
        "padded_p50_ms_370tok": 25.0, "padded_p50_ms_1000tok": None, "padded_c16_rps": None,
        "padded_mixed_c16_rps": None,
        "padded_warmup_s": None, "padded_graph_shapes_captured": None,
        "eager_p50_ms_370tok": None, "eager_c16_rps": None, "packed_groups_argmax_equal": True,
        "p50_ms_370tok": 18.5, "p99_ms_370tok": 22.0, "p99_samples_370tok": 300,
        "fresh_len_max_ratio": 1.3, "warmup_cold_s": 41.23, "warmup_cached_s": 9.0,
        "c1_rps": 50.1, "c16_rps": 85.0, "c32_rps": 95.5, "mixed_c16_rps": 70.0,
        "two_workers_c16_rps": None,  # its step failed: its number is not reported
        "graph_memory_bytes": 123456789,
        "parity_dtype": "bfloat16",
        "bf16_eager_vs_fp32_max_prob_diff": 2.5e-3, "bf16_graphs_vs_fp32_max_prob_diff": 3.0e-3,
        "bf16_argmax_mismatches": 1, "bf16_graphs_vs_eager_max_prob_diff": 1.5e-3,
        "argmax_equal": True, "packed_graphs_vs_packed_eager_max_prob_diff": 0.0,
        "packed_at_padded_settings_p50_ms_370tok": None,
        "packed_at_padded_settings_c16_rps": None,
        "packed_at_padded_settings_mixed_c16_rps": None,
        "prefix_agent_loop_speedup": 4.1, "prefix_fan_out_speedup": 6.2,
        "prefix_unrelated_speedup": 0.99, "prefix_agent_loop_max_abs_diff": 3e-3,
        # judged against benchlib/gpu_targets.py: ready_s 131.5 > 60 is the one missed
        "targets": {"p50_ms_400tok_state": True, "p50_ms_hit_400_on_6600": True,
                    "fresh_7000_vs_replay": True, "fresh_len_max_ratio": True,
                    "c32_rps": True, "prefix_agent_loop_speedup": True,
                    "prefix_fan_out_speedup": True, "prefix_unrelated_speedup": True,
                    "prefix_agent_loop_max_abs_diff": True, "kernels_per_forward": True,
                    "ready_s": False, "self_check_ms": True, "restart_ready_s": True},
    }


FELL_BACK = {"capture_problems": ["CUDA graphs were asked for but the executor serves without "
                                  "them"],
             "self_check": {"passed": True, "layout": "packed", "checked": 13,
                            "max_abs_diff": 1e-3, "fell_back_from": ["packed-graphs"]},
             "self_check_ms": 65000.0, "ready_s": 180.2}
DISAGREED = {"self_check": {"passed": False, "layout": "packed-graphs", "checked": 13,
                            "max_abs_diff": 0.02, "bound": 0.01, "fell_back_from": [],
                            "probes": [{"name": "groups", "passed": True},
                                       {"name": "small", "passed": False}]},
             "self_check_ms": 61000.0, "ready_s": 170.0}


def test_a_failed_steps_self_check_and_start_up_stay_in_the_summary() -> None:
    """The step failed (graphs dropped by a fallback): its numbers are not reported, but what
    the worker's start-up said is, and the fallback is named as the self-check's problem."""
    summary = summarise([canned("http_graphs_cold", "failed", FELL_BACK)], "d", "c")
    assert summary["self_check"] == FELL_BACK["self_check"]
    assert (summary["self_check_ms"], summary["ready_s"]) == (65000.0, 180.2)
    assert summary["self_check_problem"] == (
        "http_graphs_cold: self-check fell back from packed-graphs to packed (the serving "
        "layout disagreed with the eager answers)")
    assert summary["graph_shapes_captured"] is None and summary["c16_rps"] is None
    disagreed = summarise([canned("http_graphs_cold", "ok", DISAGREED)], "d", "c")
    assert disagreed["self_check_problem"] == (
        "http_graphs_cold: self-check disagreed on packed-graphs: max |dp| 0.02 (bound 0.01), "
        "probes ['small']")


def test_a_self_check_fallback_is_not_a_capture_failure() -> None:
    """Graphs dropped by the self-check are its problem: later graphs steps still run, and
    the step's reason names the fallback."""
    clock = FakeClock()

    def run(step: Step, limit_s: float) -> Ran:
        clock.now += 1
        return Ran(1, "", FELL_BACK) if step.name == "cold" else Ran(0, "", {})

    spec = [Step("cold", ("x",), 10, graphs=True), Step("cached", ("x",), 10, graphs=True)]
    outcomes = run_steps(spec, 100, run, clock)
    assert [o.status for o in outcomes] == ["failed", "ok"]
    assert "self-check fell back from packed-graphs" in outcomes[0].reason


@pytest.mark.parametrize(("stdout", "problem"), [
    ("....\n4 passed in 3.1s\n", ""),
    ("..s.\n3 passed, 1 skipped in 2.0s\n", "1 tests skipped (every CUDA test must run on the "
                                               "GPU)"),
    ("ssss\n4 skipped in 0.5s\n", "no test passed"),
    ("\n12 deselected in 0.2s\n", "no test passed"),
    ("", "no test passed"),
])
def test_a_pytest_step_must_have_run_its_tests(stdout: str, problem: str) -> None:
    assert unproven_tests(stdout) == problem


def test_a_pytest_step_that_skipped_fails_on_the_gpu_only() -> None:
    clock = FakeClock()
    skipped = "ss\n2 skipped in 0.1s\n"
    gpu = run_steps([Step("unit", ("x",), 10, writes_json=False, tests_must_run=True)], 100,
                    lambda step, limit: Ran(0, skipped), clock)
    assert (gpu[0].status, gpu[0].reason) == ("failed", "no test passed")
    dry = run_steps([Step("unit", ("x",), 10, writes_json=False)], 100,
                    lambda step, limit: Ran(0, skipped), clock)
    assert dry[0].status == "ok"
    real = {step.name: step for step in plan(dry_run=False)}
    assert all(real[name].tests_must_run for name in ("packed_unit", "graphs_unit",
                                                      "short_conv_unit"))
    assert not any(step.tests_must_run for step in plan(dry_run=True))


def test_answer_cache_hits_are_summed_over_the_http_steps_and_unknown_when_none_say() -> None:
    hits = [canned("http_graphs_cold", "ok", {"answer_cache_hits": 3}),
            canned("http_padded", "ok", {"answer_cache_hits": 2}),
            canned("parity_bf16", "ok", {"answer_cache_hits": 99})]  # not an HTTP step
    assert summarise(hits, "d", "c")["answer_cache_hits"] == 5
    assert summarise([canned("http_graphs_cold", "ok", {})], "d", "c")[
        "answer_cache_hits"] is None


def test_a_sitting_that_cannot_start_leaves_a_summary_with_its_error(tmp_path: Path) -> None:
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    assert main(["--out", str(out), "--scratch", str(scratch), "--deadline", "60",
                 "--error", "no wheels in .gpu/whl"]) == 1
    [summary_file] = out.glob("h200-*-summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["error"] == "no wheels in .gpu/whl"
    assert summary["commit"] and summary["p50_ms_370tok"] is None
    assert (out / "steps.jsonl").read_text() == ""  # no step ran
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # what the device returns


def test_fields_are_null_where_a_step_did_not_run_or_lacks_the_figure() -> None:
    outcomes = [canned("http_graphs_cold", "ok", {"latency": {"370": {"p50_ms": 30.0}}}),
                canned("parity_bf16", "skipped", None)]
    summary = summarise(outcomes, "2026-12-01", "abc")
    assert summary["p50_ms_370tok"] == 30.0
    assert all(summary[name] is None for name in SUMMARY_FIELDS
               if name not in ("date", "commit", "p50_ms_370tok", "targets"))
    assert set(summary["targets"].values()) == {None}  # nothing it judges was measured
    assert summary["graph_shapes_planned"] is None  # not given


def test_the_http_benches_measure_forwards_not_the_answer_cache() -> None:
    """Each HTTP step's server runs with the answer cache off (its figures are forwards) and
    the bench reads the hits back; the first step times 370 tokens a few hundred times (p99)
    and every layout step runs the mixed-length phase."""
    from bench.bench_gpu_http import parse_args, server_flags

    flags = server_flags(parse_args(["--quick"]))
    assert flags[flags.index("--answer-cache") + 1] == "0"
    planned = {step.name: step.argv for step in plan(dry_run=False)}
    cold = planned["http_graphs_cold"]
    assert int(cold[cold.index("--p99-samples") + 1]) >= 200
    for name in ("http_graphs_cold", "http_padded"):
        argv = planned[name]
        assert argv[argv.index("--mixed-concurrency") + 1] == "16", name


def test_the_commit_from_the_launcher_wins(tmp_path: Path) -> None:
    assert commit_id(tmp_path, {"CLEF_COMMIT": "feedface1234"}) == "feedface1234"
    assert commit_id(tmp_path, {"CLEF_COMMIT": " "}) == "unknown"  # blank: not a commit


def test_fla_gets_the_shipped_l2norm_config_unless_the_launcher_chose(tmp_path: Path) -> None:
    assert fla_config_env({}) == {"FLA_CONFIG_DIR": str(FLA_CONFIGS),
                                  "FLA_CACHE_MODE": "default"}
    assert fla_config_env({"FLA_CACHE_MODE": "full"}) == {}
    assert fla_config_env({"FLA_CONFIG_DIR": str(tmp_path)}) == {}
    shipped = json.loads((FLA_CONFIGS / "l2norm_fwd_kernel.json").read_text())
    assert shipped["kernel_name"] == "l2norm_fwd_kernel"
    assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= set(shipped["default_config"])


def test_fla_reads_the_shipped_config_as_the_l2norm_kernels_default() -> None:
    """fla itself (its own loader, in a process with the variables set before import) finds
    the file by the kernel's name and returns a config among the kernel's own."""
    code = ("import json\n"
            "from fla.modules.norm import l2norm\n"
            "from fla.ops.utils.cache import load_cached_config\n"
            "kernel = l2norm.l2norm_fwd_kernel\n"
            "config = load_cached_config(kernel.kernel_name)\n"
            "print(json.dumps({'config': config, 'choices': [c.kwargs for c in kernel.configs],"
            " 'warps': sorted({c.num_warps for c in kernel.configs})}))\n")
    env = {**os.environ, **fla_config_env({})}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["config"] is not None
    assert seen["config"]["kwargs"] in seen["choices"]
    assert seen["config"]["num_warps"] in seen["warps"]


def test_every_summary_field_has_a_source_in_a_planned_step_that_writes_json() -> None:
    planned = {step.name: step for step in plan(dry_run=False)}
    assert set(SOURCES) == set(SUMMARY_FIELDS) - set(OWN_FIELDS)
    for name, (step, _, _) in SOURCES.items():
        assert step in planned and planned[step].writes_json, name


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_plan_fits_one_ten_minute_command_and_names_existing_scripts(
        dry_run: bool) -> None:
    planned = plan(dry_run=dry_run)
    assert planned[0].name == "http_graphs_cold"  # graphs first: it pays the cold compile
    assert max(step.limit_s for step in planned) < 540 * (DRY_RUN_SCALE if dry_run else 1)
    # one device call of 600 s holds the deadline with 40 s to spare
    assert DEFAULT_DEADLINE_S <= 560
    real = {step.name: step.limit_s for step in plan(dry_run=False)}
    assert [step.name for step in planned] == list(real)  # the dry run runs the same plan
    from benchlib.paths import REPO

    for step in planned:
        scripts = [arg for arg in step.argv if arg.endswith(".py")]
        assert scripts and all((REPO / script).is_file() for script in scripts), step
        if dry_run and "bench/" in scripts[0]:
            assert "--quick" in step.argv, step.name
    parity = next(step for step in planned if step.name == "parity_bf16")
    assert parity.argv[parity.argv.index("--cuda-graphs") + 1] == "both"
    # parity at the longest golden length (the script's default), not 16,384
    assert "--max-length" not in parity.argv
    # the required steps fit the deadline with every limit, setup and reserve counted
    assert plan_fits(planned, DEFAULT_DEADLINE_S * (DRY_RUN_SCALE if dry_run else 1))
    assert not plan_fits([*planned, Step("more", ("x",), 60)],
                         DEFAULT_DEADLINE_S * (DRY_RUN_SCALE if dry_run else 1))
    # packed (the default) and padded measured side by side
    padded = next(step for step in planned if step.name == "http_padded")
    assert padded.argv[padded.argv.index("--batch-layout") + 1] == "padded"
    # `--out FILE` is appended to a step's argv: nothing may turn it into a positional
    assert all("--" not in step.argv for step in planned)
    # what users send, the profile and the prefix cache are required, in that order; among
    # the optional steps the parity comes first, then those the last sitting never reached,
    # then those it ran
    required = [step.name for step in planned if not step.optional]
    assert required == ["http_graphs_cold", "profile", "prefix_cache"]
    optional = [step.name for step in planned if step.optional]
    never_ran = ["graphs_unit", "short_conv_unit", "http_eager", "two_workers", "finetune"]
    ran = ["packed_unit", "http_padded", "warmup_cached", "http_packed_at_padded_settings"]
    assert optional == ["parity_bf16", *never_ran, *ran]
    same = next(step for step in planned if step.name == "http_packed_at_padded_settings")
    assert same.argv[same.argv.index("--batch-layout") + 1] == "packed"
    for flag in ("--max-length", "--max-batch-tokens", "--mixed-concurrency", "--concurrency"):
        assert same.argv[same.argv.index(flag) + 1] == padded.argv[padded.argv.index(flag) + 1]
    # the HTTP steps' servers record their self-check, never fall back (bench_gpu_http.py)
    from bench.bench_gpu_http import SELF_CHECK_REPORT, parse_args, server_flags

    flags = server_flags(parse_args(list(planned[0].argv[2:])))
    assert flags[flags.index("--self-check") + 1] == "report" == SELF_CHECK_REPORT[1]


def test_the_h200_defaults_plan_at_most_32_graph_shapes() -> None:
    planned = graph_shapes_planned()
    assert planned is not None and 0 < planned <= 32


def test_later_graph_steps_are_skipped_once_capture_failed() -> None:
    clock = FakeClock()
    calls: list[str] = []

    def run(step: Step, limit_s: float) -> Ran:
        calls.append(step.name)
        clock.now += 1
        failed = {"capture_problems": ["length buckets never captured for one row: [64]"]}
        return Ran(1, "", failed) if step.name == "cold" else Ran(0, "", {})

    spec = [Step("cold", ("x",), 10, graphs=True), Step("eager", ("x",), 10),
            Step("cached", ("x",), 10, graphs=True)]
    outcomes = run_steps(spec, 100, run, clock)
    assert calls == ["cold", "eager"]
    assert [o.status for o in outcomes] == ["failed", "ok", "skipped"]
    assert "capture failed in cold" in outcomes[2].reason


def test_a_graphs_step_with_an_eager_command_runs_it_once_capture_failed() -> None:
    clock = FakeClock()
    argvs: list[tuple[str, ...]] = []

    def run(step: Step, limit_s: float) -> Ran:
        argvs.append(step.argv)
        clock.now += 1
        failed = {"capture_problems": ["length buckets never captured for one row: [64]"]}
        return Ran(1, "", failed) if step.name == "cold" else Ran(0, "", {"dtype": "bfloat16"})

    spec = [Step("cold", ("x",), 10, graphs=True),
            Step("parity", ("p", "both"), 10, graphs=True, without_graphs=("p", "off")),
            Step("cached", ("x",), 10, graphs=True)]
    outcomes = run_steps(spec, 100, run, clock)
    assert argvs == [("x",), ("p", "off")]
    assert [o.status for o in outcomes] == ["failed", "ok", "skipped"]
    assert "without graphs" in outcomes[1].reason and "cold" in outcomes[1].reason


def test_kernel_figures_survive_a_failed_capture_in_the_real_plan() -> None:
    """Telling kernels from capture is the point of the parity step and the packed CUDA tests:
    neither is skipped when the first step's capture fails."""
    planned = {step.name: step for step in plan(dry_run=False)}
    assert not planned["packed_unit"].graphs
    parity = planned["parity_bf16"]
    assert parity.without_graphs is not None
    eager = parity.without_graphs
    assert eager[eager.index("--cuda-graphs") + 1] == "off"
    assert eager[eager.index("--dtype") + 1] == "bfloat16"


def test_a_dry_run_names_the_fields_its_finished_steps_left_null() -> None:
    """A bench whose result lost a key the summary reads: the dry run names the field (and
    fails); fields of steps that did not finish, and those quick mode never measures, do not
    count."""
    drifted = {key: value for key, value in COLD.items() if key != "throughput"}
    outcomes = [canned("http_graphs_cold", "ok", drifted),
                canned("parity_bf16", "timed_out", {}),
                canned("warmup_cached", "ok", {"warmup_ms": 9000.0, "answer_cache_hits": 0})]
    summary = summarise(outcomes, "2026-12-03", "abc")
    assert unfilled(summary, outcomes) == ["c1_rps", "c16_rps", "c32_rps"]
    complete = [canned("http_graphs_cold", "ok", COLD), *outcomes[1:]]
    assert unfilled(summarise(complete, "2026-12-03", "abc"), complete) == []


def test_the_summary_names_the_dtype_the_bf16_fields_were_measured_in() -> None:
    outcomes = [Outcome("parity_bf16", "ok", result={
        "dtype": "float32", "modes": {"off": {"max_abs_probability_diff": 1e-7}}})]
    summary = summarise(outcomes, "2026-12-03", "abc")
    assert summary["parity_dtype"] == "float32"
    assert summary["bf16_eager_vs_fp32_max_prob_diff"] == 1e-7


def test_the_commit_is_the_projects_own_never_an_enclosing_repositorys(tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    project = outer / "project"
    project.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=m"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    (outer / "f").write_text("x")
    subprocess.run([*git, "-C", str(outer), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-qm", "outer"], check=True)
    assert commit_id(project, {}) == "unknown"  # the enclosing repository's HEAD is not taken
    (project / ".gpu").mkdir()
    (project / ".gpu" / "COMMIT").write_text("abcdef123456\n")
    assert commit_id(project, {}) == "abcdef123456"
    assert commit_id(project, {"CLEF_COMMIT": "0123456789ab"}) == "0123456789ab"
    # a project that is its own checkout reports its HEAD (whole, as `clef-serve --version`)
    head = subprocess.run(["git", "-C", str(outer), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert commit_id(outer, {}) == head


def test_the_subprocess_runner_reads_the_result_and_kills_a_step_at_its_limit(
        tmp_path: Path) -> None:
    import sys

    log = tmp_path / "log.txt"
    runner = SubprocessRunner(tmp_path, log, {"PATH": "/usr/bin:/bin"})
    code = "import json, sys; open(sys.argv[-1], 'w').write(json.dumps({'x': 1})); print('hello')"
    writes = Step("writes", (sys.executable, "-c", code), 30)
    ran = runner(writes, 30)
    assert (ran.rc, ran.result, ran.stdout.strip()) == (0, {"x": 1}, "hello")
    # a step past its limit: killed with its process group, reported as no exit status
    hangs = Step("hangs", (sys.executable, "-c", "import time; time.sleep(60)"), 1,
                 writes_json=False)
    ran = runner(hangs, 1)
    assert ran.rc is None and ran.result is None
    assert "=== hangs" in log.read_text()


def test_the_session_script_without_wheels_leaves_env_and_an_error_summary(
        tmp_path: Path) -> None:
    """bench/gpu_session.sh on a host whose .gpu/ was never prepared: no step runs, and what
    comes back says why (env.txt with the versions, a summary with `error`), with the commit
    the launcher gave, in at most the 8 files the device returns."""
    import shutil

    from benchlib.paths import REPO

    copy = tmp_path / "project"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("bench", "benchlib", "clef_protocol", "clef_worker", "clef_frontend",
                   "clef_tools"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SCRATCH": str(tmp_path / "scratch"),
           "CLEF_COMMIT": "c0ffee123456", "DEADLINE": "120"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", str(copy / "bench" / "gpu_session.sh")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    [summary_file] = out.glob("h200-*-summary.json")
    summary = json.loads(summary_file.read_text())
    assert summary["error"].startswith(
        "missing in .gpu/whl: transformers-*.whl fla_core-*.whl")
    # one wheel is not enough: the other is named
    (copy / ".gpu" / "whl").mkdir(parents=True)
    (copy / ".gpu" / "whl" / "transformers-5.24.0-py3-none-any.whl").write_bytes(b"")
    done = subprocess.run(["bash", str(copy / "bench" / "gpu_session.sh")], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1
    [summary_file] = out.glob("h200-*-summary.json")
    assert json.loads(summary_file.read_text())["error"].startswith(
        "missing in .gpu/whl: fla_core-*.whl")
    assert summary["commit"] == "c0ffee123456"
    assert all(summary[name] is None for name in ("p50_ms_370tok", "answer_cache_hits"))
    environment = (out / "env.txt").read_text()
    assert "python " in environment and "torch " in environment
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8


def test_a_dry_runs_optional_time_out_does_not_fail_it_but_a_gpu_runs_does() -> None:
    steps = [Step("need", ("true",), 10.0), Step("extra", ("true",), 10.0, optional=True)]
    late = [Outcome("need", "timed_out"), Outcome("extra", "timed_out")]
    assert failing_steps(late, steps, dry_run=False) == ["need", "extra"]
    assert failing_steps(late, steps, dry_run=True) == ["need"]
    broken = [Outcome("need", "ok"), Outcome("extra", "failed")]
    assert failing_steps(broken, steps, dry_run=True) == ["extra"]

"""The GPU script's deadline scheduling and summary (benchlib/gpu_steps.py), without CUDA: a fake
clock that the fake steps advance, and canned step results."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchlib.gpu_steps import (
    DEFAULT_DEADLINE_S,
    DRY_RUN_SCALE,
    OWN_FIELDS,
    SOURCES,
    SUMMARY_FIELDS,
    Outcome,
    Ran,
    Step,
    SubprocessRunner,
    collect_autotune,
    commit_id,
    graph_shapes_planned,
    plan,
    plan_fits,
    run_steps,
    seed_autotune,
    summarise,
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


COLD = {"latency": {"370": {"p50_ms": 18.5, "p99_ms": 22.0}, "1000": {"p50_ms": 27.0},
                    "7000": {"p50_ms": 240.0}},
        "fresh_max_ratio": 1.3, "warmup_ms": 41234.0,
        "throughput": {"C1": {"req_per_s": 50.1}, "C16": {"req_per_s": 85.0},
                       "C32": {"req_per_s": 95.5}},
        "capture": {"graph_memory_bytes": 123456789, "batch_layout": "packed",
                    "captured_shapes": [[1, 64], [1, 128]]}}


def test_the_summary_has_exactly_the_fields_from_the_steps_that_succeeded() -> None:
    outcomes = [
        canned("http_graphs_cold", "ok", COLD),
        canned("parity_bf16", "ok", {"graphs_vs_eager": {"max_abs_probability_diff": 1.5e-3,
                                                         "argmax_equal": True}}),
        canned("warmup_cached", "ok", {"warmup_ms": 9000.0}),
        canned("two_workers", "failed", {"throughput": {"C16": {"req_per_s": 120.0}}}),
        # ran out of time after its latency phase: what it measured stands
        canned("http_padded", "timed_out", {"latency": {"370": {"p50_ms": 25.0}},
                                            "phase": "latency"}),
    ]
    summary = summarise(outcomes, "2026-12-01", "abc123", 28)
    assert tuple(summary) == SUMMARY_FIELDS
    assert summary == {
        "date": "2026-12-01", "commit": "abc123", "batch_layout": "packed",
        "graph_shapes_planned": 28, "graph_shapes_captured": 2,
        "padded_p50_ms_370tok": 25.0, "padded_p50_ms_1000tok": None, "padded_c16_rps": None,
        "padded_warmup_s": None, "padded_graph_shapes_captured": None,
        "eager_p50_ms_370tok": None, "eager_c16_rps": None, "packed_groups_argmax_equal": None,
        "p50_ms_370tok": 18.5,
        "p99_ms_370tok": 22.0, "p50_ms_1000tok": 27.0, "p50_ms_7000tok": 240.0,
        "fresh_len_max_ratio": 1.3, "warmup_cold_s": 41.23, "warmup_cached_s": 9.0,
        "c1_rps": 50.1, "c16_rps": 85.0, "c32_rps": 95.5,
        "two_workers_c16_rps": None,  # its step failed: its number is not reported
        "graph_memory_bytes": 123456789, "bf16_graphs_vs_eager_max_prob_diff": 1.5e-3,
        "argmax_equal": True,
    }


def test_fields_are_null_where_a_step_did_not_run_or_lacks_the_figure() -> None:
    outcomes = [canned("http_graphs_cold", "ok", {"latency": {"370": {"p50_ms": 30.0}}}),
                canned("parity_bf16", "skipped", None)]
    summary = summarise(outcomes, "2026-12-01", "abc")
    assert summary["p50_ms_370tok"] == 30.0
    assert all(summary[name] is None for name in SUMMARY_FIELDS
               if name not in ("date", "commit", "p50_ms_370tok"))
    assert summary["graph_shapes_planned"] is None  # not given


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


def test_the_commit_is_the_projects_own_never_an_enclosing_repositorys(tmp_path: Path) -> None:
    import subprocess

    outer = tmp_path / "outer"
    project = outer / "project"
    project.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=m"]
    subprocess.run([*git, "init", "-q", str(outer)], check=True)
    (outer / "f").write_text("x")
    subprocess.run([*git, "-C", str(outer), "add", "f"], check=True)
    subprocess.run([*git, "-C", str(outer), "commit", "-qm", "outer"], check=True)
    assert commit_id(project) == "unknown"  # the enclosing repository's HEAD is not taken
    (project / ".gpu").mkdir()
    (project / ".gpu" / "COMMIT").write_text("abcdef123456\n")
    assert commit_id(project) == "abcdef123456"
    # a project that is its own checkout reports its HEAD
    head = subprocess.run(["git", "-C", str(outer), "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert commit_id(outer) == head


def test_autotune_results_come_back_and_seed_the_next_cache(tmp_path: Path) -> None:
    cache, out, seed = tmp_path / "cache", tmp_path / "out", tmp_path / "seed"
    (cache / "abc").mkdir(parents=True)
    (cache / "abc" / "kernel.autotune.json").write_text('{"BT": 64}')
    (cache / "abc" / "kernel.cubin").write_bytes(b"\0")
    assert collect_autotune(cache, out) == 1
    assert (out / "abc" / "kernel.autotune.json").read_text() == '{"BT": 64}'
    assert not (out / "abc" / "kernel.cubin").exists()
    # the next sitting: an empty cache, seeded from what came back
    out.rename(seed)
    fresh = tmp_path / "fresh"
    assert seed_autotune(fresh, seed) == 1
    assert (fresh / "abc" / "kernel.autotune.json").read_text() == '{"BT": 64}'
    assert seed_autotune(fresh, seed) == 0  # never overwrites
    assert seed_autotune(fresh, tmp_path / "none") == 0


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

"""The GPU script's deadline scheduling and summary (benchlib/gpu_steps.py), without CUDA: a fake
clock that the fake steps advance, and canned step results."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchlib.gpu_steps import (
    DRY_RUN_SCALE,
    SOURCES,
    SUMMARY_FIELDS,
    Outcome,
    Ran,
    Step,
    SubprocessRunner,
    plan,
    run_steps,
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
        "capture": {"graph_memory_bytes": 123456789}}


def test_the_summary_has_exactly_the_fields_from_the_steps_that_succeeded() -> None:
    outcomes = [
        canned("http_graphs_cold", "ok", COLD),
        canned("parity_bf16", "ok", {"graphs_vs_eager": {"max_abs_probability_diff": 1.5e-3,
                                                         "argmax_equal": True}}),
        canned("warmup_cached", "ok", {"warmup_ms": 9000.0}),
        canned("two_workers", "failed", {"throughput": {"C16": {"req_per_s": 120.0}}}),
    ]
    summary = summarise(outcomes, "2026-12-01", "abc123")
    assert tuple(summary) == SUMMARY_FIELDS
    assert summary == {
        "date": "2026-12-01", "commit": "abc123", "p50_ms_370tok": 18.5,
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


def test_every_summary_field_has_a_source_in_a_planned_step_that_writes_json() -> None:
    planned = {step.name: step for step in plan(dry_run=False)}
    assert set(SOURCES) == set(SUMMARY_FIELDS) - {"date", "commit"}
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

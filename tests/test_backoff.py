"""The restart back-off rule (backoff.py): crash loops back off, useful work resets it."""

from __future__ import annotations

from clef_dispatch.backoff import RestartBackoff


def backoff() -> RestartBackoff:
    return RestartBackoff(initial=0.5, cap=4.0, reset_after=60.0)


def test_a_crash_loop_doubles_up_to_the_cap() -> None:
    rule = backoff()
    delays = [rule.worker_died(uptime=1.0, served=0).delay for _ in range(6)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_failed_starts_count_as_a_crash_loop() -> None:
    rule = backoff()
    first = rule.worker_died(uptime=1.0, served=0)
    second = rule.start_failed()
    third = rule.start_failed()
    assert [first.delay, second.delay, third.delay] == [0.5, 1.0, 2.0]
    assert "during start-up" in third.reason and "3 consecutive failures" in third.reason


def test_workers_that_served_never_grow_the_delay() -> None:
    # Each replacement answers ~100 requests and is then killed: workers that served were not
    # crash-looping, so the restart delay must not grow.
    rule = backoff()
    decisions = [rule.worker_died(uptime=5.0, served=100) for _ in range(6)]
    assert [d.delay for d in decisions] == [0.5] * 6
    assert decisions[-1].reason == "served 100 requests before dying"


def test_one_answer_resets_a_crash_loop() -> None:
    rule = backoff()
    for _ in range(4):
        rule.worker_died(uptime=1.0, served=0)
    assert rule.worker_died(uptime=1.0, served=1).delay == 0.5
    # Counting starts again, from the first crash-loop death after it.
    assert [rule.worker_died(uptime=1.0, served=0).delay for _ in range(3)] == [0.5, 1.0, 2.0]


def test_a_long_uptime_without_traffic_also_resets() -> None:
    rule = backoff()
    for _ in range(3):
        rule.worker_died(uptime=1.0, served=0)
    decision = rule.worker_died(uptime=61.0, served=0)
    assert decision.delay == 0.5 and decision.reason == "up 61s before dying"


def test_the_reason_names_a_crash_loop() -> None:
    rule = backoff()
    assert rule.worker_died(uptime=0.2, served=0).reason == "crash loop: no request answered"
    assert rule.worker_died(uptime=0.2, served=0).reason == (
        "crash loop: no request answered (2 consecutive failures)")


def test_huge_failure_counts_stay_finite() -> None:
    rule = RestartBackoff(initial=1.0, cap=30.0, reset_after=60.0, failures=10_000)
    assert rule.start_failed().delay == 30.0

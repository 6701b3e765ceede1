"""The slow-body rule (clef_frontend/body_rate.py), driven by an injected clock: no sleeps."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from clef_frontend.body_rate import BodyRateRule

RULE = BodyRateRule(inactivity=30.0, min_rate=1024.0, grace=5.0)
T0 = 1000.0  # an arbitrary monotonic clock reading


def test_one_byte_a_second_is_cut_off_after_the_grace_period() -> None:
    clock = RULE.start(T0, expected=8 * 1024 * 1024)
    now = T0
    while clock.too_slow(now) is None:
        assert now - T0 < 60, "a trickled body was never cut off"
        assert clock.wait_limit(now) > 0
        now += 1.0
        clock.record(1, now)
    # The old rule (silence only) never fires here: a byte came every second.
    assert now - T0 == 5.0  # as soon as the grace period ends
    assert "under the minimum 1024 B/s" in (clock.too_slow(now) or "")
    assert clock.wait_limit(now) == 0.0


def test_a_body_just_above_the_minimum_rate_is_never_cut_off() -> None:
    expected = 100 * 1024
    clock = RULE.start(T0, expected=expected)
    now = T0
    while clock.received < expected:
        clock.record(520, now)  # 1,040 B/s, in half-second bursts
        now += 0.5
        assert clock.too_slow(now) is None
    assert clock.deadline() == math.inf  # complete: nothing left to time


def test_a_slow_start_is_forgiven_within_the_grace_period() -> None:
    clock = RULE.start(T0, expected=20_000)
    assert clock.wait_limit(T0) == 5.0  # no byte yet: the grace period, not the 30 s silence
    clock.record(10_000, T0 + 4.9)  # nothing for 4.9 s, then a burst
    assert clock.too_slow(T0 + 4.9) is None
    # 10,000 bytes cover 10000/1024 = 9.77 s of the minimum rate.
    assert math.isclose(clock.deadline(), T0 + 10_000 / 1024)
    assert clock.too_slow(T0 + 9.7) is None
    assert clock.too_slow(T0 + 9.8) is not None


def test_silence_alone_still_times_out() -> None:
    rule = BodyRateRule(inactivity=2.0, min_rate=0.0, grace=5.0)  # rate check off
    clock = rule.start(T0, expected=10)
    clock.record(1, T0 + 1.0)
    assert clock.wait_limit(T0 + 1.0) == 2.0
    assert clock.too_slow(T0 + 2.9) is None
    assert clock.too_slow(T0 + 3.0) == "no body byte for 2s"


def test_a_total_body_deadline_follows_from_the_length() -> None:
    # A body of n bytes sent at exactly the minimum rate must be complete by grace or n / rate.
    clock = RULE.start(T0, expected=8 * 1024 * 1024)
    clock.record(8 * 1024 * 1024 - 1, T0 + 100.0)
    assert math.isclose(clock.rate_deadline(), T0 + (8 * 1024 * 1024 - 1) / 1024)


@given(chunks=st.lists(st.tuples(st.floats(0.0, 3.0), st.integers(0, 4096)), max_size=50))
def test_the_wait_limit_is_exactly_the_time_to_the_first_broken_rule(
    chunks: list[tuple[float, int]],
) -> None:
    clock = RULE.start(T0, expected=1_000_000)
    now = T0
    for gap, count in chunks:
        limit = clock.wait_limit(now)
        if gap >= limit:
            assert clock.too_slow(now + limit + 1e-9) is not None
            return
        now += gap
        assert clock.too_slow(now) is None
        clock.record(count, now)

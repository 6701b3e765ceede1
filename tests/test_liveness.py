"""The suspect rule (clef_dispatch/liveness.py) on a hand-driven clock: when a silent
worker is suspect, when it is wedged, and that a forward ahead of its pong never gets it killed
before the stall timeout."""

from __future__ import annotations

import pytest

from clef_dispatch.liveness import (
    ESTIMATE_FACTOR,
    FLOOR_SECONDS,
    ForwardRates,
    Liveness,
    Verdict,
    idle_kill_after,
    ping_interval,
)

STALL = 30.0  # the default --stall-timeout


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def watched(rates: ForwardRates | None = None, stall: float = STALL
            ) -> tuple[Liveness, Clock]:
    clock = Clock()
    return Liveness(stall_timeout=stall, rates=rates or ForwardRates(), clock=clock), clock


def taught(seconds: float, body_bytes: int = 100) -> ForwardRates:
    """Rates that learned one forward: a body of `body_bytes` answered in `seconds`."""
    rates = ForwardRates()
    rates.observe(body_bytes, body_bytes, seconds * 1000.0)
    return rates


def test_an_idle_worker_is_never_judged() -> None:
    liveness, clock = watched()
    clock.advance(3600)
    judgement = liveness.judge()
    assert judgement.verdict is Verdict.HEALTHY and judgement.next_look is None


def test_a_pong_owed_with_nothing_ahead_is_suspect_after_the_floor_then_wedged() -> None:
    liveness, clock = watched()
    liveness.ping_sent()
    clock.advance(FLOOR_SECONDS)
    assert liveness.judge().verdict is Verdict.HEALTHY
    clock.advance(0.01)
    judgement = liveness.judge()
    assert judgement.verdict is Verdict.SUSPECT
    assert judgement.reason.startswith("no pong for 0.51s (nothing ahead")
    # Nothing it could be running explains the silence: killed well before the stall timeout.
    assert judgement.kill_after == idle_kill_after(STALL) < STALL
    assert judgement.next_look == pytest.approx(clock.now - 0.51 + judgement.kill_after, abs=0.01)
    assert judgement.next_look is not None
    clock.now = judgement.next_look  # the timer's next look finds it wedged
    assert liveness.judge().verdict is Verdict.WEDGED


def test_a_suspect_that_answers_is_healthy_again() -> None:
    liveness, clock = watched()
    liveness.ping_sent()
    clock.advance(2.0)
    assert liveness.judge().verdict is Verdict.SUSPECT
    liveness.pong()
    assert liveness.judge().verdict is Verdict.HEALTHY


def test_requests_sent_after_the_ping_cannot_delay_its_pong() -> None:
    """The worker reads its pipe in order: the ping comes first, so however long the request
    behind it, the pong is owed within the floor."""
    liveness, clock = watched(taught(seconds=1.0))
    liveness.ping_sent()
    liveness.request_sent(1, body_bytes=70_000)  # a 16k-token request behind the ping
    clock.advance(FLOOR_SECONDS + 0.01)
    assert liveness.judge().verdict is Verdict.SUSPECT
    # It holds a request now, but none ahead of the pong: still the early kill.
    assert liveness.judge().kill_after == idle_kill_after(STALL)


def test_a_request_ahead_of_the_pong_gets_its_estimated_time_times_the_factor() -> None:
    liveness, clock = watched(taught(seconds=1.5, body_bytes=1200))
    liveness.request_sent(1, body_bytes=1000)  # about the same size: 1.5 s
    liveness.ping_sent()
    judgement = liveness.judge()
    assert judgement.allowed == pytest.approx(ESTIMATE_FACTOR * 1.5)
    clock.advance(ESTIMATE_FACTOR * 1.5 - 0.01)
    assert liveness.judge().verdict is Verdict.HEALTHY
    clock.advance(0.02)
    judgement = liveness.judge()
    assert judgement.verdict is Verdict.SUSPECT
    assert judgement.kill_after == STALL  # a forward is ahead: never killed before the stall


def test_a_forward_ahead_is_never_killed_before_the_stall_timeout_however_wrong_the_guess() -> None:
    liveness, clock = watched(taught(seconds=0.001))  # learned from tiny forwards
    liveness.request_sent(1, body_bytes=70_000)
    liveness.ping_sent()
    for _ in range(29):
        clock.advance(1.0)
        assert liveness.judge().verdict is not Verdict.WEDGED
    assert liveness.judge().verdict is Verdict.SUSPECT
    clock.advance(1.0)
    assert liveness.judge().verdict is Verdict.WEDGED


def test_without_any_forward_observed_held_work_waits_for_the_stall_timeout() -> None:
    liveness, clock = watched()
    liveness.request_sent(1, body_bytes=100)
    liveness.ping_sent()
    assert liveness.judge().allowed == STALL
    clock.advance(STALL - 0.01)
    assert liveness.judge().verdict is Verdict.HEALTHY
    clock.advance(0.01)
    assert liveness.judge().verdict is Verdict.WEDGED


def test_a_reply_restarts_the_count_for_what_is_still_ahead() -> None:
    liveness, clock = watched(taught(seconds=1.0, body_bytes=1000))
    liveness.request_sent(1, body_bytes=1000)  # 1 s each
    liveness.request_sent(2, body_bytes=1000)
    liveness.ping_sent()
    assert liveness.judge().allowed == pytest.approx(ESTIMATE_FACTOR * 2.0)
    clock.advance(3.0)
    liveness.request_answered(1, tokens=1000, worker_ms=3000.0)  # slower than thought: learned
    judgement = liveness.judge()
    assert judgement.silent == 0.0
    assert judgement.allowed == pytest.approx(ESTIMATE_FACTOR * 3.0)  # the slowest recent one


def test_without_pings_a_reply_is_owed_for_all_the_work_held() -> None:
    liveness, clock = watched(taught(seconds=0.1))
    clock.advance(100.0)  # idle silence does not count
    liveness.request_sent(1, body_bytes=100)
    liveness.request_sent(2, body_bytes=100)
    judgement = liveness.judge()
    assert judgement.silent == 0.0
    assert judgement.allowed == FLOOR_SECONDS  # 0.2 s of work, times the factor, is below it
    clock.advance(FLOOR_SECONDS + 0.01)
    assert liveness.judge().reason.startswith("no reply for 0.51s (2 request(s) ahead")


def test_rates_scale_recent_forwards_of_about_the_same_size() -> None:
    rates = ForwardRates(window=3)
    assert rates.estimate(100) is None
    rates.observe(100, 0, 5.0)  # a refusal: no forward
    rates.observe(100, 50, None)  # an older worker: no time
    assert not rates.known
    rates.observe(100, 120, 200.0)
    rates.observe(150, 170, 240.0)
    # About the same size: the slowest, scaled up (never down) to the request's size.
    assert rates.estimate(120) == pytest.approx(max(0.2 * 1.2, 0.24))
    assert rates.estimate(300) == pytest.approx(0.24 * 2)
    # Only smaller ones: linearly up from them (their fixed cost too: it errs long).
    assert rates.estimate(1000) == pytest.approx(max(0.2 * 10, 0.24 * 1000 / 150))
    # Only bigger ones: the fastest of them bounds it.
    rates.observe(70_000, 16384, 5000.0, cut=True)  # its state cut to fit --max-length
    assert rates.estimate(20) == pytest.approx(0.2)
    # A forward cut to --max-length costs the same for any bigger body.
    assert rates.estimate(1_000_000) == pytest.approx(5.0)
    for _ in range(3):
        rates.observe(100, 100, 10.0)  # the window forgets the old ones
    assert rates.estimate(100) == pytest.approx(0.01)


def test_pings_go_out_every_quarter_second_and_only_one_is_owed() -> None:
    liveness, clock = watched()
    assert ping_interval(STALL) == FLOOR_SECONDS / 2 and ping_interval(0.3) == pytest.approx(0.1)
    assert liveness.ping_due()
    liveness.ping_sent()
    clock.advance(1.0)
    assert not liveness.ping_due() and liveness.next_ping_at() is None
    liveness.pong()
    assert liveness.ping_due()
    liveness.ping_sent()
    liveness.pong()
    assert not liveness.ping_due()
    assert liveness.next_ping_at() == pytest.approx(clock.now + ping_interval(STALL))


def test_a_short_stall_timeout_bounds_every_margin() -> None:
    liveness, clock = watched(stall=0.3)
    liveness.ping_sent()
    clock.advance(0.29)
    judgement = liveness.judge()
    assert (judgement.verdict, judgement.allowed, judgement.kill_after) == (Verdict.HEALTHY,
                                                                             0.3, 0.3)
    assert judgement.next_look is not None
    clock.now = judgement.next_look
    assert liveness.judge().verdict is Verdict.WEDGED

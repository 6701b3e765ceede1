"""A silent worker is suspect after a short margin (clef_dispatch/liveness.py): it gets no new work,
what it holds is answered elsewhere (the first answer wins), /health and a counter show it; it is
killed at --stall-timeout, or sooner when it owes a pong with nothing ahead of it; a slow but
live forward is never killed. Through a real front, at the front's default --stall-timeout (30 s)
unless a test says otherwise; fake workers except the last test (the real tiny worker on CPU)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import WAIT, Serve, background, clef_body
from tests.traffic_helpers import metric, wait_until

STALL = 30.0  # the front's default --stall-timeout: these tests never wait for it


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` for the block; SIGCONT afterwards if it still exists."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def warm(serve: Serve, count: int = 4) -> None:
    """Both workers answer a few requests: their recent forwards are known."""
    for i in range(count):
        assert serve.post(clef_body(tag=f"warm{i}")).status == 200


def test_an_idle_worker_stopped_is_suspect_its_requests_answered_by_the_other() -> None:
    with Serve(front_args=("--workers", "2")) as serve:
        warm(serve)
        pid0, pid1 = (w["pid"] for w in serve.health().json()["workers"])
        with stopped(pid0):
            answers = [serve.post(clef_body(tag=f"t{i}")) for i in range(10)]
            assert [r.status for r in answers] == [200] * 10
            assert {r.json()["pid"] for r in answers} == {pid1}
            health = serve.health().json()
            assert health["status"] == "ready" and health["suspect_workers"] == ["0"]
            suspect = health["workers"][0]["suspect"]
            assert suspect["reason"].startswith("no pong for")
            assert suspect["kill_after_s"] < STALL  # nothing ahead of its pong: killed sooner
            assert health["waiting_for"] is None  # worker 1 serves
            assert metric(serve, "clef_worker_suspects_total") >= 1
            # Nothing ahead of the pong it owes: replaced before the stall timeout.
            serve.wait_for(rf"worker pid={pid0} failed .*no pong within 10s with no request "
                           r"ahead of it .*reason=stalled", timeout=STALL)
        after = serve.wait_health(lambda h: h["ready_workers"] == ["0", "1"]
                                  and not h["suspect_workers"], timeout=WAIT * 3)
        assert after["workers"][0]["pid"] != pid0
        assert metric(serve, "clef_worker_restarts_total", reason="stalled") == 1


def test_a_worker_stopped_mid_forward_its_request_answered_elsewhere_and_its_late_answer_dropped(
        tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    with Serve("--log-file", str(log), front_args=("--workers", "2")) as serve:
        warm(serve)
        pid0, pid1 = (w["pid"] for w in serve.health().json()["workers"])
        held = serve.hold_in_flight(gate, tag="held")  # on worker 0 (round robin)
        assert serve.health().json()["workers"][0]["in_flight"] == 1
        with stopped(pid0):
            serve.wait_health(lambda h: h["suspect_workers"] == ["0"])
            # A copy goes to worker 1 by the ordinary rule; it holds it too until the gate.
            serve.wait_health(lambda h: h["workers"][1]["in_flight"] == 1)
            gate.touch()
            answer = held.result()
            assert answer.status == 200 and answer.json()["pid"] == pid1
        # Let go, worker 0 finishes its copy: that answer is dropped, and it is healthy again.
        serve.wait_for(r"answered again by a second worker: the later answer is dropped")
        serve.wait_for(rf"worker 0 pid={pid0} answered again: healthy")
        after = serve.wait_health(lambda h: not h["suspect_workers"] and h["in_flight"] == 0)
        assert after["restarts"] == 0 and after["workers"][0]["pid"] == pid0
        assert log.read_text().split().count("held") == 2  # sent twice, answered once
        assert metric(serve, "clef_requests_resent_total", reason="suspect") == 1
        assert serve.post(clef_body(tag="next")).status == 200


@pytest.mark.parametrize("front_args, headers", [
    ((), [("X-Clef-Deadline-Ms", "200")]),
    (("--queue-timeout", "0.2"), []),  # counted from admission: a long forward outlives it
], ids=["deadline-header", "queue-timeout"])
def test_a_request_on_a_suspect_worker_whose_deadline_passes_gets_its_own_answer(
        tmp_path: Path, front_args: tuple[str, ...], headers: list[tuple[str, str]]) -> None:
    """A request held by worker 0 outlives its deadline, then worker 0 turns suspect: the
    deadline rule sends no copy and expires nothing (a request on a worker is answered), so
    the client gets worker 0's own 200 once it goes on, and so does an identical request that
    joined it; nothing ran twice."""
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    with Serve("--log-file", str(log), front_args=("--workers", "2", *front_args)) as serve:
        warm(serve)
        pid0 = serve.health().json()["workers"][0]["pid"]
        body = clef_body(tag="held", hold_until=str(gate))
        held = background(lambda: serve.post(body, headers=headers))  # worker 0: round robin
        serve.wait_health(lambda h: h["workers"][0]["in_flight"] == 1)
        joiner = background(lambda: serve.post(body))
        wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 1, "the joiner")
        with stopped(pid0):
            serve.wait_health(lambda h: h["suspect_workers"] == ["0"])
            serve.wait_for(r"deadline passed while a worker holds it: no copy sent")
            gate.touch()
        answer, joined = held.result(), joiner.result()
        assert answer.status == 200 and answer.json()["pid"] == pid0
        assert joined.status == 200 and joined.body == answer.body
        assert log.read_text().split().count("held") == 1  # never sent again, nor re-admitted
        assert metric(serve, "clef_answer_cache_total", result="coalesced") == 1
        assert metric(serve, "clef_requests_resent_total", reason="suspect") == 0
        assert metric(serve, "clef_deadline_expired_total", **{"class": "interactive"}) == 0
        serve.wait_health(lambda h: not h["suspect_workers"] and h["in_flight"] == 0)


def test_a_long_silent_forward_past_the_queue_timeout_is_answered_not_expired(
        tmp_path: Path) -> None:
    """`--queue-timeout 0.2` (this test's setting) counts from admission, so a 2 s forward, silent
    as the real worker's are, is past it when its worker turns suspect: it is not expired and
    sent nowhere else, and its own answer is the client's 200."""
    log = tmp_path / "requests.log"
    with Serve("--silent-forwards", "--log-file", str(log),
               front_args=("--workers", "2", "--queue-timeout", "0.2")) as serve:
        warm(serve)
        pid0 = serve.health().json()["workers"][0]["pid"]
        slow = serve.post(clef_body(tag="slow", sleep=2.0))  # worker 0: round robin
        assert slow.status == 200 and slow.json()["pid"] == pid0
        assert metric(serve, "clef_worker_suspects_total") >= 1
        serve.wait_for(r"deadline passed while a worker holds it: no copy sent")
        assert log.read_text().split().count("slow") == 1
        assert metric(serve, "clef_requests_resent_total", reason="suspect") == 0
        assert metric(serve, "clef_deadline_expired_total", **{"class": "interactive"}) == 0


def test_a_slow_but_live_forward_may_be_suspect_but_is_never_killed() -> None:
    """The fake worker, silent during its forwards as the real one is, takes 2 s where its
    recent forwards took milliseconds: suspect, its request sent to the other worker (just as
    slow), one answer to the client, no worker killed, both healthy again."""
    with Serve("--silent-forwards", front_args=("--workers", "2")) as serve:
        warm(serve)
        slow = serve.post(clef_body(tag="slow", sleep=2.0))
        assert slow.status == 200
        assert metric(serve, "clef_worker_suspects_total") >= 1
        serve.wait_for(r"answered again by a second worker: the later answer is dropped")
        after = serve.wait_health(lambda h: not h["suspect_workers"] and h["in_flight"] == 0)
        assert after["restarts"] == 0
        assert metric(serve, "clef_worker_restarts_total", reason="stalled") == 0


def test_with_one_worker_a_suspects_requests_wait_for_its_answer_and_health_says_why() -> None:
    with Serve("--silent-forwards") as serve:
        warm(serve, 2)
        pid = serve.health().json()["worker"]["pid"]
        slow = background(lambda: serve.post(clef_body(tag="slow", sleep=2.0)))
        health = serve.wait_health(lambda h: h["waiting_for"] is not None)
        assert health["status"] == "ready" and health["suspect_workers"] == ["0"]
        assert "worker 0 is suspect (no pong for" in health["waiting_for"]
        assert "wait for its answer or its replacement" in health["waiting_for"]
        answer = slow.result()
        assert answer.status == 200 and answer.json()["pid"] == pid
        after = serve.wait_health(lambda h: h["waiting_for"] is None)
        assert after["restarts"] == 0 and after["worker"]["pid"] == pid


def test_real_workers_a_16k_forward_is_not_killed_and_an_idle_wedge_costs_nothing() -> None:
    """Two real workers on the tiny snapshot (CPU), the front's defaults: a request cut to 16k
    tokens takes seconds on CPU and is slow, not stuck; then one worker stopped while idle
    costs clients nothing."""
    state = " ".join(f"word{i}" for i in range(8000))  # cut to --max-length: 16k tokens
    long_body = json.dumps({"model": "m", "state": state,
                            "questions": {"q": {"type": "noul"}}}).encode()
    with Serve(real_worker=True, startup_wait=240, max_batch=None, answer_cache=None,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                           "--workers", "2")) as serve:
        warm(serve)
        with serve.connect(timeout=STALL) as client:
            client.send("POST", "/v1/systemone", long_body)
            answer = client.read_response()
        assert answer.status == 200
        assert answer.json()["usage"]["input_tokens"] == 16384
        health = serve.health().json()
        assert health["restarts"] == 0
        with stopped(health["workers"][0]["pid"]):
            answers = [serve.post(clef_body(tag=f"t{i}")) for i in range(10)]
            assert [r.status for r in answers] == [200] * 10
            assert serve.health().json()["suspect_workers"] == ["0"]
        assert metric(serve, "clef_worker_suspects_total") >= 1

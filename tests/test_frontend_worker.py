"""The front and its worker: one process, one thread, strict order, failures and restarts."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.frontend_helpers import WAIT, Serve, background, clef_body


def test_concurrent_posts_are_answered_by_one_pid_on_its_main_thread() -> None:
    with Serve() as serve:
        worker_pid = serve.health().json()["worker"]["pid"]
        with ThreadPoolExecutor(max_workers=8) as pool:
            responses = list(pool.map(lambda i: serve.post(clef_body(tag=f"c{i}")), range(24)))
    assert [r.status for r in responses] == [200] * 24
    answers = [r.json() for r in responses]
    assert {a["pid"] for a in answers} == {worker_pid}
    assert {a["thread"] for a in answers} == {"MainThread"}
    assert sorted(a["tag"] for a in answers) == sorted(f"c{i}" for i in range(24))


def test_worker_intervals_never_overlap_and_follow_admission_order(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # One in flight, so t1..t4 wait in the queue in admission order behind the held t0.
    with Serve("--delay", "0.1", front_args=("--queue-size", "8"), max_batch=1) as serve:
        # Admit one request at a time, each only once the previous one is visibly admitted, so
        # the admission order is known: t0 held in flight, then t1..t4 queued in that order.
        pending = [serve.hold_in_flight(gate, "t0"), *serve.queue([f"t{i}" for i in range(1, 5)])]
        gate.touch()
        answers = [p.result().json() for p in pending]
    assert [a["tag"] for a in answers] == [f"t{i}" for i in range(5)]
    ordered = sorted(answers, key=lambda a: a["start_ns"])
    assert [a["tag"] for a in ordered] == [f"t{i}" for i in range(5)]
    assert [a["request_id"] for a in ordered] == sorted(a["request_id"] for a in answers)
    for earlier, later in itertools.pairwise(ordered):
        assert earlier["end_ns"] <= later["start_ns"], (earlier, later)


def test_unordered_burst_is_still_serialised() -> None:
    with Serve("--delay", "0.02") as serve, ThreadPoolExecutor(max_workers=6) as pool:
        answers = [r.json() for r in pool.map(lambda i: serve.post(clef_body(tag=str(i))),
                                              range(12))]
    by_id = sorted(answers, key=lambda a: a["request_id"])
    # Completion order is admission order (ids are assigned at admission, in order).
    assert [a["start_ns"] for a in by_id] == sorted(a["start_ns"] for a in by_id)
    for earlier, later in itertools.pairwise(by_id):
        assert earlier["end_ns"] <= later["start_ns"]


def test_library_print_in_the_worker_does_not_break_the_protocol() -> None:
    with Serve() as serve:
        response = serve.post(clef_body(tag="noisy", print=True))
        assert response.status == 200 and response.json()["tag"] == "noisy"
        serve.wait_for("library chatter on stdout")
        serve.wait_for("C library chatter on fd 1")
        assert serve.post(clef_body(tag="after")).json()["tag"] == "after"
        assert serve.health().json()["restarts"] == 0


def test_worker_crash_mid_request_resends_it_to_the_replacement(tmp_path) -> None:
    """One worker: the request it died with waits for the replacement and is answered there;
    what merely waited in the queue gets 503, as do new requests, until the replacement is
    ready."""
    marker = tmp_path / "crashed"
    ready_gate = tmp_path / "replacement may start"
    # One in flight: the second request waits in the queue while the first crashes the worker.
    with Serve("--crash-once-file", str(marker), "--replacement-ready-gate", str(ready_gate),
               max_batch=1) as serve:
        old_pid = serve.health().json()["worker"]["pid"]
        gate = tmp_path / "gate"
        doomed_call = background(lambda: serve.post(clef_body(tag="doomed", crash=True,
                                                              hold_until=str(gate))))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        queued = serve.connect()
        queued.send("POST", "/v1/systemone", clef_body(tag="queued"))
        serve.wait_health(lambda h: h["queue_depth"] == 1)
        gate.touch()
        behind = queued.read_response()
        queued.close()
        assert behind.status == 503 and behind.header("Retry-After") is not None
        assert behind.detail == "worker is restarting"
        # The replacement is held before `ready`: /health says so meanwhile.
        during = serve.health()
        assert during.status == 503 and during.json()["status"] == "restarting"
        assert during.header("Retry-After") is not None
        assert during.json()["queue_depth"] == 1  # the resent request waits for it
        refused = serve.post(clef_body(tag="too early"))
        assert refused.status == 503 and refused.detail == "worker is restarting"
        ready_gate.touch()
        doomed = doomed_call.result()
        after = serve.wait_health(lambda h: h["status"] == "ready")
        assert doomed.status == 200 and doomed.json()["tag"] == "doomed"
        assert doomed.json()["pid"] == after["worker"]["pid"] != old_pid
        assert after["restarts"] == 1
        answer = serve.post(clef_body(tag="next"))
        assert answer.status == 200
        assert answer.json()["pid"] == after["worker"]["pid"] != old_pid
        serve.wait_for(rf"worker pid={old_pid} failed")
        assert not _alive_or_zombie(old_pid)


@pytest.mark.parametrize(
    ("marker", "logged"),
    [("garbage", r"invalid frame from worker"), ("oversize", r"exceeds the maximum")],
)
def test_garbage_or_an_oversize_frame_from_the_worker_is_a_worker_failure(
    marker: str, logged: str
) -> None:
    with Serve() as serve:
        old_pid = serve.health().json()["worker"]["pid"]
        response = serve.post(clef_body(**{marker: True}))
        assert (response.status, response.detail) == (500, "inference failed")
        serve.wait_for(logged)
        after = serve.wait_health(lambda h: h["status"] == "ready")
        assert after["worker"]["pid"] != old_pid
        assert serve.post(clef_body(tag="ok")).status == 200


def test_repeated_crashes_back_off() -> None:
    # Every worker crashes on the poison request (sent once more after the first crash, so
    # each costs two workers); the delays logged must grow.
    with Serve(front_args=("--restart-backoff", "0.05", "--restart-backoff-max", "0.4")) as serve:
        for _ in range(2):
            serve.wait_health(lambda h: h["status"] == "ready")
            assert serve.post(clef_body(crash=True)).status == 500
        serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == 4)
        delays = [float(m) for m in re.findall(r"starting a new worker in ([0-9.]+)s",
                                                serve.stderr)]
        assert delays[:4] == [0.05, 0.1, 0.2, 0.4]


def test_worker_killed_while_idle_is_replaced_and_reaped() -> None:
    with Serve("--ready-delay", "0.3") as serve:
        old_pid = serve.health().json()["worker"]["pid"]
        os.kill(old_pid, signal.SIGKILL)
        serve.wait_for(rf"worker pid={old_pid} failed .*exit code -9")
        assert not _alive_or_zombie(old_pid)  # reaped before the restart begins
        after = serve.wait_health(lambda h: h["status"] == "ready")
        assert after["restarts"] == 1 and after["worker"]["pid"] != old_pid
        assert serve.post(clef_body(tag="again")).json()["pid"] == after["worker"]["pid"]


def _alive_or_zombie(pid: int) -> bool:
    # A process table entry exists while the child runs and while it is an unreaped zombie.
    return os.path.exists(f"/proc/{pid}")


def test_replacement_that_sends_fatal_is_retried(tmp_path) -> None:
    poison = tmp_path / "poison"
    with Serve("--fatal-once-file", str(poison)) as serve:
        old_pid = serve.health().json()["worker"]["pid"]
        poison.touch()  # the next worker to start refuses once
        os.kill(old_pid, signal.SIGKILL)
        serve.wait_for(r"replacement worker failed to start: worker could not start: "
                       r"GPU still held by the previous worker")
        after = serve.wait_health(lambda h: h["status"] == "ready")
        assert after["restarts"] == 1 and after["worker"]["pid"] != old_pid
        assert not poison.exists()
        assert serve.post(clef_body()).status == 200


def test_a_hung_worker_is_replaced_after_the_request_timeout(tmp_path: Path) -> None:
    never = tmp_path / "never created"
    with Serve(front_args=("--request-timeout", "0.5")) as serve:
        old_pid = serve.health().json()["worker"]["pid"]
        started = time.monotonic()
        stuck = serve.post(clef_body(tag="stuck", hold_until=str(never)))
        assert stuck.status == 500 and stuck.detail == "inference failed"
        assert time.monotonic() - started < WAIT
        serve.wait_for(rf"worker pid={old_pid} failed after .*no reply to request \d+ within 0.5s")
        # It hung the worker it was sent again to as well: two workers replaced, then a 500.
        after = serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == 2)
        assert after["worker"]["pid"] != old_pid
        assert serve.post(clef_body(tag="next")).json()["pid"] == after["worker"]["pid"]
        assert not _alive_or_zombie(old_pid)

"""Wedged workers: the front pings each worker; one silent for --stall-timeout is killed and
replaced (restart reason `stalled`) and its requests are sent again (fake worker, SIGSTOP)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

from tests.frontend_helpers import WAIT, Serve, background, clef_body
from tests.traffic_helpers import load, metric

STALL = 1.0  # --stall-timeout in these tests; the default (30 s) is for real forwards


def test_sigstop_of_one_of_two_workers_every_request_answered_within_the_stall_timeout(
        tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve("--delay", "0.01", front_args=("--workers", "2", "--max-batch", "2",
                                              "--stall-timeout", str(STALL))) as serve:
        pid0, pid1 = (w["pid"] for w in serve.health().json()["workers"])
        held = serve.hold_in_flight(gate, tag="held")  # on worker 0 when it is stopped
        stopped = threading.Event()

        def stop_when_loaded() -> None:
            serve.wait_health(lambda h: h["in_flight"] >= 3)
            os.kill(pid0, signal.SIGSTOP)
            gate.touch()  # too late: the stopped worker cannot see it
            stopped.set()

        stopper = background(stop_when_loaded)
        try:
            answers = load(serve, [clef_body(tag=f"t{i}") for i in range(40)], clients=4)
            stopper.result()
            rescued = held.result(timeout=WAIT)
        finally:
            if not stopped.is_set():
                os.kill(pid0, signal.SIGCONT)
        assert [r.status for r, _ in answers] == [200] * 40
        # Nobody waited much longer than the stall timeout (plus a third of it between pings,
        # plus a margin for a 2-core machine): not the request timeout (300 s).
        assert max(seconds for _, seconds in answers) < STALL * 4 / 3 + 3.0
        assert rescued.status == 200 and rescued.json()["pid"] != pid0
        serve.wait_for(rf"worker pid={pid0} failed .*no pong and no reply within 1s.*"
                       r"reason=stalled\)")
        assert metric(serve, "clef_worker_restarts_total", reason="stalled") == 1
        assert metric(serve, "clef_requests_resent_total", reason="stalled") >= 1
        assert pid1 in {r.json()["pid"] for r, _ in answers}


def test_a_wedged_idle_worker_is_found_by_its_pings_and_replaced() -> None:
    with Serve(front_args=("--stall-timeout", str(STALL))) as serve:
        pid = serve.health().json()["worker"]["pid"]
        os.kill(pid, signal.SIGSTOP)  # no request in flight: only the pings can tell
        serve.wait_for(rf"worker pid={pid} failed .*no pong and no reply within 1s")
        after = serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == 1)
        assert after["worker"]["pid"] != pid
        assert serve.post(clef_body()).status == 200


def test_a_worker_that_answers_pings_is_never_declared_stalled() -> None:
    """Idle for several stall timeouts: the pings keep it alive (the fake worker answers them)."""
    with Serve(front_args=("--stall-timeout", "0.3", "--log-level", "DEBUG")) as serve:
        pid = serve.health().json()["worker"]["pid"]
        serve.wait_for(rf"worker pid={pid}: pong 10\b")  # ten rounds: a full second and more
        assert metric(serve, "clef_worker_restarts_total", reason="stalled") == 0
        assert serve.health().json()["worker"]["pid"] == pid
        assert serve.post(clef_body()).status == 200


def test_a_worker_without_pings_is_judged_by_its_requests_alone() -> None:
    """A worker whose ready frame does not offer pings is never sent one (an older worker
    exits on a frame it does not know); a wedged one is still found once a request waits on it,
    and that request is answered by its replacement."""
    with Serve("--no-pings", front_args=("--stall-timeout", str(STALL),
                                         "--log-level", "DEBUG")) as serve:
        pid = serve.health().json()["worker"]["pid"]
        assert serve.post(clef_body(tag="before")).status == 200
        # The scenario itself, not a synchronisation: the worker stays idle (silent) for longer
        # than the stall timeout, which must not count against it.
        time.sleep(STALL * 1.5)
        after_idle = serve.post(clef_body(tag="after idle"))
        assert after_idle.status == 200 and after_idle.json()["pid"] == pid
        os.kill(pid, signal.SIGSTOP)
        rescued = serve.post(clef_body(tag="rescued"))
        assert rescued.status == 200 and rescued.json()["pid"] != pid
        serve.wait_for(rf"worker pid={pid} failed .*no pong and no reply within 1s "
                       r"\(1 request\(s\) in flight\)")
        assert not re.search(r": pong \d+", serve.stderr)  # never pinged


def test_a_hung_worker_says_where_it_was_stuck_before_it_is_replaced() -> None:
    """A worker wedged inside a request (the fake worker's `wedge` marker: alive, silent) is
    asked for its stack before the kill: the log shows the frame it was stuck in, then the
    failure and the replacement."""
    with Serve(front_args=("--stall-timeout", str(STALL))) as serve:
        pid = serve.health().json()["worker"]["pid"]
        # Sent again alone after the first stall, it wedges the replacement too: a 500.
        assert serve.post(clef_body(wedge=True)).status == 500
        serve.wait_for(rf"worker pid={pid} failed .*reason=stalled\)")
        stderr = serve.stderr
    assert f"worker pid={pid} is stuck: asking for its stack" in stderr
    # Between the worker's ready and its failure (the front may write its own "is stuck" line
    # after the worker's first stack lines: it writes at the end of an event-loop turn).
    ready = re.search(rf"worker ready: .* pid={pid} ", stderr)
    assert ready is not None
    failed = stderr.index(f"worker pid={pid} failed")
    stack = stderr.index("most recent call first", ready.end())
    assert stack < failed
    assert re.search(r'File ".*fake_worker\.py", line \d+ in answer', stderr[stack:failed])

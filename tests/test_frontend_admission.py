"""Admission and shutdown: FIFO queue, 503 when full, clients that leave, slow uploaders, drain."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.frontend_helpers import Serve, build_request, clef_body

# The queue tests hold one request at the worker and need the next ones to wait in the queue:
# one request in flight per worker instead of the CPU default.
ONE = 1


def test_full_queue_is_503_with_retry_after(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve(front_args=("--queue-size", "1", "--retry-after", "3"), max_batch=ONE) as serve:
        running = serve.hold_in_flight(gate)
        [waiting] = serve.queue(["waiting"])
        refused = serve.post(clef_body(tag="refused"))
        assert refused.status == 503
        assert refused.detail == "queue is full"
        assert refused.header("Retry-After") == "3"
        # Health is answered at once, from front state, while the queue is full.
        assert serve.health().json()["status"] == "ready"
        gate.touch()
        assert running.result().json()["tag"] == "running"
        assert waiting.result().json()["tag"] == "waiting"


def test_client_that_leaves_while_queued_never_reaches_the_worker(tmp_path: Path) -> None:
    seen, gate = tmp_path / "seen.txt", tmp_path / "gate"
    with Serve("--log-file", str(seen), max_batch=ONE) as serve:
        running = serve.hold_in_flight(gate)
        leaver = serve.connect()
        leaver.send("POST", "/v1/systemone", clef_body(tag="gone"))
        serve.wait_health(lambda h: h["queue_depth"] == 1)
        leaver.close()
        # Dropped while the first request still runs: the queue empties without a dispatch.
        state = serve.wait_health(lambda h: h["queue_depth"] == 0)
        assert state["in_flight"] == 1
        serve.wait_for(r"dropped from the queue: client gone")
        gate.touch()
        assert running.result().status == 200
        assert serve.post(clef_body(tag="after")).json()["tag"] == "after"
    assert seen.read_text().split() == ["running", "after"]


def test_client_that_leaves_in_flight_does_not_desync_the_channel(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve() as serve:
        leaver = serve.connect()
        leaver.send("POST", "/v1/systemone", clef_body(tag="left", hold_until=str(gate)))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        leaver.close()
        serve.wait_for(r"status=499")
        gate.touch()
        # Its reply is still read; the next request gets its own answer, not the orphan's.
        answer = serve.post(clef_body(tag="mine"))
        assert answer.json()["tag"] == "mine"


def test_stalled_body_does_not_delay_other_clients() -> None:
    # A body timeout far longer than the test: the stalled client cannot be answered (408)
    # before the other clients are, however slow the machine. The 408 itself is a contract test.
    with Serve(front_args=("--body-timeout", "600")) as serve:
        request = build_request("POST", "/v1/systemone", clef_body(tag="slow"))
        cut = len(request) - 20  # the head and most of the body, not its last 20 bytes
        stalled = serve.connect()
        stalled.send_raw(request[:cut])
        tags = [serve.post(clef_body(tag=f"fast{i}")).json()["tag"] for i in range(5)]
        assert tags == [f"fast{i}" for i in range(5)]
        assert serve.health().status == 200
        assert not stalled.has_data(0.0)  # still waiting for its body, not yet answered
        stalled.send_raw(request[cut:])  # the rest: now it is served
        response = stalled.read_response()
        assert (response.status, response.json()["tag"]) == (200, "slow")
        stalled.close()


def test_sigterm_finishes_in_flight_and_queued_requests_then_exits_0(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve(max_batch=ONE) as serve:
        probe, idle = serve.connect(), serve.connect()
        for client in (probe, idle):  # accepted, answered, now idle keep-alive connections
            client.send("GET", "/health")
            assert client.read_response().status == 200
        calls = [serve.hold_in_flight(gate, "d0"), *serve.queue(["d1", "d2", "d3"])]
        serve.terminate()
        serve.wait_for(r"SIGTERM received")
        # The drain is held open by d0: existing connections still get answers, with close.
        probe.send("GET", "/health")
        draining = probe.read_response()
        assert draining.status == 503 and draining.json()["status"] == "draining"
        assert draining.json()["queue_depth"] == 3
        assert draining.header("Retry-After") is not None
        assert draining.header("Connection") == "close" and probe.at_eof()
        gate.touch()
        answers = [call.result() for call in calls]
        assert [a.status for a in answers] == [200] * 4
        assert [a.json()["tag"] for a in answers] == [f"d{i}" for i in range(4)]
        assert idle.at_eof()  # idle keep-alive connections are closed once drained
        assert serve.wait_exit() == 0
        serve.wait_for(r"worker pid=\d+ stopped \(exit code 0\)")
        probe.close()
        idle.close()


def test_drain_timeout_answers_the_rest_503(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve(front_args=("--drain-timeout", "0.2"), max_batch=ONE) as serve:
        calls = [serve.hold_in_flight(gate, "d0"), *serve.queue(["d1", "d2"])]
        serve.terminate()
        refused = [call.result() for call in calls[1:]]
        assert [(a.status, a.detail) for a in refused] == [(503, "server is draining")] * 2
        gate.touch()
        assert calls[0].result().status == 200  # in flight: its reply is still forwarded
        assert serve.wait_exit() == 0


def test_new_requests_during_drain_are_refused(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve() as serve:
        late = serve.connect()
        late.send("GET", "/health")
        assert late.read_response().status == 200
        running = serve.hold_in_flight(gate)
        body = clef_body(tag="late")
        head = build_request("POST", "/v1/systemone", body)
        late.send_raw(head[: -len(body)])  # headers before the signal, body after it
        serve.terminate()
        serve.wait_for(r"SIGTERM received")
        late.send_raw(body)
        refused = late.read_response()
        assert (refused.status, refused.detail) == (503, "server is draining")
        assert refused.header("Connection") == "close"
        gate.touch()
        assert running.result().status == 200
        assert serve.wait_exit() == 0
        late.close()


def test_sigint_stops_like_sigterm(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve() as serve:
        running = serve.hold_in_flight(gate)
        serve.process.send_signal(signal.SIGINT)
        serve.wait_for(r"SIGINT received")
        gate.touch()
        assert running.result().status == 200
        assert serve.wait_exit() == 0
        serve.wait_for(r"worker pid=\d+ stopped \(exit code 0\)")

"""Admission and shutdown: FIFO queue, 503 when full, clients that leave, slow uploaders, drain."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.frontend_helpers import Serve, background, build_request, clef_body


def test_full_queue_is_503_with_retry_after() -> None:
    with Serve("--delay", "0.6", front_args=("--queue-size", "1", "--retry-after", "3")) as serve:
        running = background(lambda: serve.post(clef_body(tag="running")))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        waiting = background(lambda: serve.post(clef_body(tag="waiting")))
        serve.wait_health(lambda h: h["queue_depth"] == 1)
        refused = serve.post(clef_body(tag="refused"))
        assert refused.status == 503
        assert refused.detail == "queue is full"
        assert refused.header("Retry-After") == "3"
        # Health is answered at once, from front state, while the queue is full.
        assert serve.health().json()["status"] == "ready"
        assert running.result().json()["tag"] == "running"
        assert waiting.result().json()["tag"] == "waiting"


def test_client_that_leaves_while_queued_never_reaches_the_worker(tmp_path: Path) -> None:
    seen = tmp_path / "seen.txt"
    with Serve("--delay", "0.5", "--log-file", str(seen)) as serve:
        running = background(lambda: serve.post(clef_body(tag="running")))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        leaver = serve.connect()
        leaver.send("POST", "/v1/systemone", clef_body(tag="gone"))
        serve.wait_health(lambda h: h["queue_depth"] == 1)
        leaver.close()
        # Dropped while the first request still runs: the queue empties without a dispatch.
        state = serve.wait_health(lambda h: h["queue_depth"] == 0)
        assert state["in_flight"] == 1
        serve.wait_for(r"dropped from the queue: client gone")
        assert running.result().status == 200
        assert serve.post(clef_body(tag="after")).json()["tag"] == "after"
    assert seen.read_text().split() == ["running", "after"]


def test_client_that_leaves_in_flight_does_not_desync_the_channel() -> None:
    with Serve("--delay", "0.3") as serve:
        leaver = serve.connect()
        leaver.send("POST", "/v1/systemone", clef_body(tag="left"))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        leaver.close()
        # Its reply is still read; the next request gets its own answer, not the orphan's.
        answer = serve.post(clef_body(tag="mine"))
        assert answer.json()["tag"] == "mine"
        serve.wait_for(r"status=499")


def test_stalled_body_does_not_delay_other_clients() -> None:
    with Serve(front_args=("--body-timeout", "1.5")) as serve:
        body = clef_body(tag="slow")
        stalled = serve.connect()
        stalled.send_raw(build_request("POST", "/v1/systemone", body)[: -len(body) // 2])
        tags = [serve.post(clef_body(tag=f"fast{i}")).json()["tag"] for i in range(5)]
        assert tags == [f"fast{i}" for i in range(5)]
        assert serve.health().status == 200
        assert not stalled.has_data(0.0)  # still waiting for its body, not yet answered
        response = stalled.read_response()
        assert (response.status, response.detail) == (408, "request body timed out")
        assert stalled.at_eof()
        stalled.close()


def test_sigterm_finishes_in_flight_and_queued_requests_then_exits_0() -> None:
    with Serve("--delay", "0.3") as serve:
        calls = []
        for i in range(4):
            calls.append(background(lambda i=i: serve.post(clef_body(tag=f"d{i}"))))
            serve.wait_health(lambda h, i=i: h["in_flight"] + h["queue_depth"] == i + 1)
        idle = serve.connect()
        idle.send("GET", "/health")
        assert idle.read_response().status == 200
        half = serve.connect()
        half.send_raw(b"GET /health HTTP/1.1\r\n")  # a request under way when the signal comes
        serve.terminate()
        serve.wait_for(r"SIGTERM received")
        assert idle.at_eof()  # idle keep-alive connections are closed at once
        half.send_raw(b"Host: x\r\n\r\n")
        draining = half.read_response()
        assert draining.status == 503 and draining.json()["status"] == "draining"
        assert draining.header("Retry-After") is not None
        answers = [call.result() for call in calls]
        assert [a.status for a in answers] == [200] * 4
        assert [a.json()["tag"] for a in answers] == [f"d{i}" for i in range(4)]
        assert serve.wait_exit() == 0
        serve.wait_for(r"worker pid=\d+ stopped \(exit code 0\)")
        idle.close()
        half.close()


def test_drain_timeout_answers_the_rest_503() -> None:
    with Serve("--delay", "0.6", front_args=("--drain-timeout", "0.2")) as serve:
        calls = []
        for i in range(3):
            calls.append(background(lambda i=i: serve.post(clef_body(tag=f"d{i}"))))
            serve.wait_health(lambda h, i=i: h["in_flight"] + h["queue_depth"] == i + 1)
        serve.terminate()
        answers = [call.result() for call in calls]
        assert answers[0].status == 200  # in flight: its reply is still read and forwarded
        assert [(a.status, a.detail) for a in answers[1:]] == [(503, "server is draining")] * 2
        assert serve.wait_exit() == 0


def test_new_requests_during_drain_are_refused() -> None:
    with Serve("--delay", "0.5") as serve:
        running = background(lambda: serve.post(clef_body(tag="running")))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        late = serve.connect()
        body = clef_body(tag="late")
        head = build_request("POST", "/v1/systemone", body)
        late.send_raw(head[: -len(body)])  # headers before the signal, body after it
        serve.terminate()
        serve.wait_for(r"SIGTERM received")
        late.send_raw(body)
        refused = late.read_response()
        assert (refused.status, refused.detail) == (503, "server is draining")
        assert refused.header("Connection") == "close"
        assert running.result().status == 200
        assert serve.wait_exit() == 0
        late.close()


def test_sigint_stops_like_sigterm() -> None:
    with Serve("--delay", "0.3") as serve:
        running = background(lambda: serve.post(clef_body(tag="running")))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        serve.process.send_signal(signal.SIGINT)
        assert running.result().status == 200
        assert serve.wait_exit() == 0
        serve.wait_for(r"SIGINT received")
        serve.wait_for(r"worker pid=\d+ stopped \(exit code 0\)")

"""Deadlines: a request still waiting when its deadline (X-Clef-Deadline-Ms, --queue-timeout)
passes gets 504 and never reaches a worker (the fake worker's request log)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.doubles import Admission, FakeLane, FakeWorkers
from tests.frontend_helpers import Serve, background, clef_body
from tests.traffic_helpers import metric


@pytest.mark.parametrize(("front_args", "headers"), [
    ((), [("X-Clef-Deadline-Ms", "300")]),
    (("--queue-timeout", "0.3"), []),
    (("--queue-timeout", "600"), [("X-Clef-Deadline-Ms", "300"), ("X-Clef-Priority", "bulk")]),
])
def test_a_deadline_that_passes_in_the_queue_never_reaches_the_worker(
        tmp_path: Path, front_args: tuple[str, ...], headers: list[tuple[str, str]]) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    # One in flight, so "late" waits in the queue behind the held request until its deadline.
    with Serve("--log-file", str(log), front_args=front_args, max_batch=1) as serve:
        running = serve.hold_in_flight(gate)
        late = background(lambda: serve.post(clef_body(tag="late"), headers=headers))
        expired = late.result()  # answered while the worker is still busy
        assert expired.status == 504
        assert expired.detail == "deadline passed before a worker was free"
        assert serve.health().json()["queue_depth"] == 0
        gate.touch()
        assert running.result().status == 200
        assert serve.post(clef_body(tag="after")).status == 200
        assert log.read_text().split() == ["running", "after"]  # "late" never reached it
        priority = dict(headers).get("X-Clef-Priority", "interactive")
        assert metric(serve, "clef_deadline_expired_total", **{"class": priority}) == 1
        serve.wait_for(r"frame_id=\d+ request_id=\S+ class=\w+: deadline passed after \d+ ms")


def test_a_request_within_its_deadline_is_answered(tmp_path: Path) -> None:
    with Serve(front_args=("--queue-timeout", "60")) as serve:
        answer = serve.post(clef_body(tag="quick"), headers=[("X-Clef-Deadline-Ms", "60000")])
        assert answer.status == 200 and answer.json()["tag"] == "quick"
        assert metric(serve, "clef_deadline_expired_total", **{"class": "interactive"}) == 0


def test_a_malformed_deadline_is_400() -> None:
    with Serve() as serve:
        for value in ("0", "-5", "soon", "1.5", "86400001"):
            refused = serve.post(clef_body(), headers=[("X-Clef-Deadline-Ms", value)])
            assert refused.status == 400
            assert refused.detail == ("X-Clef-Deadline-Ms must be a whole number of "
                                      f"milliseconds from 1 to 86400000, got {value!r}")


def test_a_request_whose_client_left_is_not_sent_even_before_the_socket_is_watched() -> None:
    """Right before the frame, admission asks whether the client is still there."""

    async def scenario() -> tuple[list[bytes], bool]:
        lane = FakeLane(room=1)
        admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(lane))
        admission.submit(b"busy")
        client_left = False
        left = admission.submit(b"left", gone=lambda: client_left)
        stays = admission.submit(b"stays")
        client_left = True  # its EOF arrived; no watcher has read it yet
        while lane.held:
            lane.answer_oldest()
        await stays.outcome
        return lane.sent, left.outcome.cancelled()

    sent, cancelled = asyncio.run(scenario())
    assert sent == [b"busy", b"stays"] and cancelled


def test_deadlines_of_tickets_that_left_the_queue_are_not_kept_for_the_queue_timeout() -> None:
    """With `--queue-timeout`, every queued ticket's deadline goes on a heap; a ticket sent and
    answered long before it must not stay referenced there (with its body) until then."""

    async def scenario() -> tuple[int, int, int]:
        lane = FakeLane(room=1)
        admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(lane),
                              queue_timeout=600)
        admission.submit(b"busy")
        most = 0
        for number in range(1000):
            waiting = admission.submit(b"body %d" % number)  # queued behind the one in flight
            lane.answer_oldest()  # the one in flight answers; the queued one is sent
            assert not waiting.outcome.done() and lane.held
            most = max(most, len(admission._deadlines))  # the heap, read for this test only
        expiring = admission.submit(b"still queued")
        assert any(ticket is expiring for ticket in admission._deadlines.tickets())
        return most, admission.depth, len(lane.sent)

    most, depth, sent = asyncio.run(scenario())
    assert sent == 1001 and depth == 1
    assert most <= 2 * 1 + 64 + 1  # twice the depth plus the slack, never a thousand

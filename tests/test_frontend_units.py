"""The front's pure parts, without processes: framing scan, route table, checks, bodies."""

from __future__ import annotations

import asyncio
import json
import re

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clef_api import responses
from clef_api.catalogue import Catalogue
from clef_api.checks import RequestRules, media_type
from clef_api.framing import _scan_lines, reparse_without_framing, scan_framing
from clef_api.responses import Reply
from clef_api.routes import Route, route
from clef_dispatch import Refusal, RefusalKind, WorkerSettings
from clef_dispatch import admission as admission_
from clef_dispatch.admission import Ticket
from clef_frontend.config import ServerConfig
from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.messages import WorkerReply
from clef_protocol.options import RequestLimits
from tests.doubles import Admission, FakeLane, FakeWorkers, reply_of

LIMIT = 8 * 1024 * 1024
RULES = RequestRules(RequestLimits(), Catalogue(("clef-flash",)), LIMIT)


def head(*lines: str) -> bytes:
    return ("\r\n".join(["POST /v1/systemone HTTP/1.1", "Host: x", *lines]) + "\r\n\r\n").encode()


def test_scan_framing_keeps_every_line_as_sent() -> None:
    framing = scan_framing(head("Content-Length: 5", "content-length:5 ", "Transfer-Encoding: x"))
    assert framing.content_lengths == (b"5", b"5")
    assert framing.transfer_encodings == (b"x",)


def test_scan_framing_accepts_bare_lf_like_h11() -> None:
    framing = scan_framing(b"POST / HTTP/1.1\nHost: x\nContent-Length: 7\n\n")
    assert framing.content_lengths == (b"7",)


_HEAD_LINES = st.lists(st.sampled_from([
    "Content-Length: 5", "content-length:7 ", "CONTENT-LENGTH:\t12\t", "Content-Length : 3",
    " Content-Length: 9", "Transfer-Encoding: chunked", "X-Note: content-length", "Host: y",
    "X-Content-Length: 4", "Accept: */*", "Content-Type: application/json"]), max_size=5)


@given(_HEAD_LINES, st.sampled_from(["/v1/systemone", "/content-length"]), st.booleans())
def test_scan_framing_fast_path_agrees_with_the_line_by_line_scan(
        lines: list[str], target: str, bare_lf: bool) -> None:
    raw = "\r\n".join([f"POST {target} HTTP/1.1", "Host: x", *lines]) + "\r\n\r\n"
    if bare_lf:
        raw = raw.replace("\r\n", "\n")
    assert scan_framing(raw.encode()) == _scan_lines(raw.encode())


@given(st.text(alphabet="0123456789+-abc ,.", max_size=12))
def test_content_length_rule_matches_the_contract(value: str) -> None:
    framing = scan_framing(head("Content-Length: " + value))
    outcome = RULES.check_head(framing, b"application/json")
    stripped = value.strip(" ")
    if not re.fullmatch(r"[0-9]+", stripped):
        assert isinstance(outcome, Reply) and outcome.status == 400
    elif int(stripped) > LIMIT:
        assert isinstance(outcome, Reply) and outcome.status == 413
    else:
        assert outcome == int(stripped)


def test_checks_run_in_contract_order() -> None:
    def status(*lines: str, content_type: bytes | None = b"application/json") -> int:
        outcome = RULES.check_head(scan_framing(head(*lines)), content_type)
        return outcome.status if isinstance(outcome, Reply) else 0

    assert status("Transfer-Encoding: chunked", content_type=None) == 411
    assert status("Content-Length: 1", "Content-Length: x") == 411
    assert status("Content-Length: x", content_type=None) == 400
    assert status(f"Content-Length: {LIMIT + 1}", content_type=None) == 413
    assert status(f"Content-Length: {LIMIT}", content_type=None) == 415
    assert status(f"Content-Length: {LIMIT}") == 0


def test_media_type() -> None:
    assert media_type(b"Application/JSON ; charset=UTF-8") == "application/json"
    assert media_type(None) is None
    assert media_type(b"") == ""


def test_route_table() -> None:
    for known in Route:
        assert route(known.method, known.path) is known
    assert route(b"GET", b"/health") is Route.HEALTH
    assert route(b"POST", b"/v1/systemone") is Route.SYSTEMONE
    refused = route(b"POST", b"/health")
    assert isinstance(refused, Reply) and (refused.status, refused.allow) == (405, "GET")
    missing = route(b"GET", b"/health?x=1")
    assert isinstance(missing, Reply) and missing.status == 404


def test_rescue_parses_a_head_h11_refused_for_its_framing_only() -> None:
    raw = head("Content-Length: abc", "Content-Type: application/json")
    with pytest.raises(h11.RemoteProtocolError):
        connection = h11.Connection(h11.SERVER)
        connection.receive_data(raw)
        connection.next_event()
    rescued = reparse_without_framing(raw)
    assert rescued is not None
    _, request = rescued
    assert (request.method, request.target) == (b"POST", b"/v1/systemone")
    assert (b"content-type", b"application/json") in list(request.headers)


def test_rescue_reports_the_fault_of_heads_that_are_malformed_anyway() -> None:
    for raw in (b"GARBAGE\r\nContent-Length: x\r\n\r\n", head("Content-Length: x", "Bad Header"),
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n"):  # no Host
        with pytest.raises(h11.RemoteProtocolError) as refused:
            reparse_without_framing(raw)
        assert refused.value.error_status_hint == 400
    assert reparse_without_framing(head("Content-Length: x", " folded")) is None
    assert reparse_without_framing(head("X-Other: 1")) is None  # nothing to remove


def test_error_bodies_are_serialised_as_the_contract_says() -> None:
    reply = responses.error(422, "é: type must be noul, choice, or score")
    assert reply.body == '{"detail": "é: type must be noul, choice, or score"}'.encode()
    headers = dict(reply.headers(close=True))
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Length"] == str(len(reply.body))
    assert headers["Connection"] == "close"
    unavailable = responses.unavailable("queue is full", 2)
    assert dict(unavailable.headers(close=False))["Retry-After"] == "2"


def test_worker_500_never_leaks_its_cause() -> None:
    reply = responses.from_worker(WorkerReply(500, None, "Traceback: secret path", 1.0))
    assert json.loads(reply.body) == {"detail": "inference failed"}
    ok = responses.from_worker(WorkerReply(200, b'{"b":1,"a":2}', None, 1.0))
    assert ok.body == b'{"b":1,"a":2}'


def test_a_worker_reply_without_a_valid_status_is_a_protocol_failure() -> None:
    good = messages.response(7, b"{}", 1.0)
    assert messages.from_worker(good) == WorkerReply(200, b"{}", None, 1.0, id=7)
    for broken in ({k: v for k, v in good.items() if k != "status"}, {**good, "status": "200"},
                   {**good, "status": 422}):
        with pytest.raises(ProtocolError, match="malformed response frame"):
            messages.from_worker(broken)
    refusal = messages.error(7, 422, "bad", 1.0)
    reply = messages.from_worker(refusal)
    assert isinstance(reply, WorkerReply) and reply.detail == "bad"
    with pytest.raises(ProtocolError, match="malformed error frame"):
        messages.from_worker({k: v for k, v in refusal.items() if k != "status"})


_FRAMING_VALUES = st.sampled_from(["5", "abc", "5, 5", "-1", "+5", " 5", "chunked", "gzip", ""])


@given(st.lists(st.tuples(st.sampled_from(["Content-Length", "Transfer-Encoding"]),
                          _FRAMING_VALUES), min_size=1, max_size=3))
def test_every_head_rescued_from_bad_framing_is_refused_by_rows_1_to_4(
    framing_lines: list[tuple[str, str]],
) -> None:
    """The connection never reads the body of a rescued head: rows 1-4 always answer first."""
    raw = head(*(f"{name}: {value}" for name, value in framing_lines),
               "Content-Type: application/json")
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(raw)
    try:
        connection.next_event()
    except h11.RemoteProtocolError:
        pass
    else:
        return  # h11 accepted the framing: nothing to rescue
    rescued = reparse_without_framing(raw)
    assert rescued is not None
    outcome = RULES.check_head(scan_framing(raw), b"application/json")
    assert isinstance(outcome, Reply) and outcome.status in (400, 411)


def test_config_refuses_a_body_limit_beyond_one_frame() -> None:
    with pytest.raises(ValueError, match="does not fit a worker frame"):
        ServerConfig(WorkerSettings(("w",)), body_limit=64 * 1024 * 1024)
    ServerConfig(WorkerSettings(("w",)), body_limit=8 * 1024 * 1024)


def test_admission_is_fifo_and_drops_abandoned_tickets() -> None:
    async def scenario() -> list[bytes]:
        lane = FakeLane(room=1)
        admission = Admission(capacity=3, retry_after=1, workers=FakeWorkers(lane))
        tickets = [admission.submit(str(i).encode()) for i in (1, 2, 3, 4)]
        assert (admission.in_flight, admission.depth) == (1, 3)
        refused = admission_.Admission.submit(admission, b"5")
        assert refused == Refusal(RefusalKind.UNAVAILABLE, "queue is full", 1)
        admission.abandon(tickets[2])  # "3" leaves while queued
        while lane.held:
            lane.answer_oldest()
        for ticket in (tickets[0], tickets[1], tickets[3]):
            assert (await reply_of(ticket)).body == ticket.body
        await admission.wait_idle()
        return lane.sent

    assert asyncio.run(scenario()) == [b"1", b"2", b"4"]


@given(rooms=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       script=st.lists(st.tuples(st.booleans(), st.integers(0, 2)), min_size=1, max_size=40))
def test_admission_keeps_fifo_per_worker_and_answers_each_request_once(
    rooms: list[int], script: list[tuple[bool, int]]
) -> None:
    """Random arrivals and answers over 1-3 workers with room for 1-4 each: every request is
    answered exactly once, each worker is sent requests in admission order, and a request is
    never sent while an older one still waits."""

    async def scenario() -> None:
        lanes = [FakeLane(room) for room in rooms]
        admission = Admission(capacity=1000, retry_after=1, workers=FakeWorkers(*lanes))
        tickets: list[Ticket] = []
        answered: list[bytes] = []
        for arrive, which in script:
            if arrive:
                tickets.append(admission.submit(str(len(tickets)).encode()))
            else:
                lane = lanes[which % len(lanes)]
                if lane.held:
                    lane.answer_oldest()
            sent = [body for lane in lanes for body in lane.sent]
            # FIFO: what was sent is exactly the oldest tickets, and what waits is the rest.
            assert sorted(int(b) for b in sent) == list(range(len(sent)))
            assert admission.depth == len(tickets) - len(sent)
        while any(lane.held for lane in lanes):
            for lane in lanes:
                if lane.held:
                    lane.answer_oldest()
        for ticket in tickets:
            reply = await reply_of(ticket)
            answered.append(reply.body)
        assert answered == [t.body for t in tickets]
        for lane in lanes:
            assert [int(b) for b in lane.sent] == sorted(int(b) for b in lane.sent)
        await asyncio.wait_for(admission.wait_idle(), 1)

    asyncio.run(scenario())


def test_a_crashed_worker_fails_only_its_own_requests() -> None:
    async def scenario() -> None:
        doomed, healthy = FakeLane(room=2), FakeLane(room=2)
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(doomed, healthy))
        tickets = [admission.submit(str(i).encode()) for i in range(6)]
        assert [b for b in doomed.sent] == [b"0", b"2"] and healthy.sent == [b"1", b"3"]
        doomed.ready = False
        doomed.crash()  # both of its requests fail; the queue moves on to the other worker
        assert [(await reply_of(t)).status for t in (tickets[0], tickets[2])] == [500, 500]
        while healthy.held:
            healthy.answer_oldest()
        assert [(await reply_of(t)).status for t in (tickets[1], tickets[3], tickets[4],
                                                    tickets[5])] == [200] * 4
        assert doomed.sent == [b"0", b"2"]

    asyncio.run(scenario())

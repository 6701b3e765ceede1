"""The resend rules on their own (clef_dispatch/resend.py): what a worker's outcome means for a
ticket, and where lost tickets and suspects' copies wait (how admission counts them is
tests/test_waiting_counts.py's)."""

from __future__ import annotations

import asyncio

from clef_dispatch.deadline_heap import Past, past_deadline
from clef_dispatch.resend import Resends, Verdict, judge
from clef_dispatch.ticket import AdmissionEvents, Ticket
from clef_dispatch.urgency import BULK, CLASSES, INTERACTIVE
from clef_dispatch.waiting import TicketQueue
from clef_dispatch.worker_errors import WorkerFailure, WorkerLost
from clef_protocol.messages import WorkerReply


def _ticket(loop: asyncio.AbstractEventLoop, frame_id: int, priority: str = INTERACTIVE) -> Ticket:
    return Ticket(frame_id, b"{}", loop.create_future(), priority=priority)


def test_judge_names_each_case() -> None:
    loop = asyncio.new_event_loop()
    try:
        plain = dict(in_flight_elsewhere=False, lost_waiting=False, copy_queued=False)
        ticket = _ticket(loop, 1)
        assert judge(ticket, WorkerLost("died"), **plain) is Verdict.RESEND
        assert judge(ticket, WorkerFailure("bad"), **plain) is Verdict.FAILED
        assert judge(ticket, WorkerLost("died"),
                     **{**plain, "copy_queued": True}) is Verdict.RESEND_COPY
        assert judge(ticket, WorkerFailure("bad"),
                     **{**plain, "in_flight_elsewhere": True}) is Verdict.OTHER_DUE
        ticket.resent = True  # never a second resend: a poison request fails
        assert judge(ticket, WorkerLost("died"), **plain) is Verdict.FAILED
        reply = WorkerReply(200, b"{}", None, 1.0)
        assert judge(ticket, reply, **plain) is Verdict.ANSWERED
        ticket.outcome.set_result(None)  # type: ignore[arg-type]
        assert judge(ticket, reply, **plain) is Verdict.LATE
    finally:
        loop.close()


def test_lost_tickets_and_copies_wait_apart_and_keep_their_deadline() -> None:
    loop = asyncio.new_event_loop()
    try:
        kept: list[Ticket] = []
        resent: list[str] = []
        resends = Resends(events=AdmissionEvents(resent=resent.append), resend_timeout=30.0,
                          keep_deadline=kept.append)
        waiting = {name: TicketQueue() for name in CLASSES}
        lost, held_a, held_b = _ticket(loop, 1, BULK), _ticket(loop, 2), _ticket(loop, 3)
        for ticket in (lost, held_a, held_b):
            ticket.sent(0.0)
        resends.lose(lost, WorkerLost("died"))
        assert lost.resent and lost.deadline is not None and kept == [lost]
        resends.copy([held_a, held_b], waiting)
        resends.copy([held_a], waiting)  # one copy per ticket, ever
        assert list(waiting[INTERACTIVE]) == [held_a, held_b]  # oldest first at the head
        # Neither a lost ticket queued nor a queued copy is a resend yet (admission counts each
        # once sent: `sent_again`); a copy's deadline is kept like any waiting ticket's.
        assert resent == []  # nothing is counted until really sent again
        assert kept == [lost, held_b, held_a]
        # the copies wait in their class queue, the lost ticket apart from it (each queued once)
        assert [resends.is_copy(t) for t in (lost, held_a, held_b)] == [False, True, True]
        assert resends.is_lost_waiting(lost) and not waiting[BULK]
        assert all(t.queued for t in (lost, held_a, held_b))
        assert resends.to_take_back([held_b]) == [held_b] and not held_b.copied
        assert resends.lost_waiting and resends.pop_lost() == (lost, "crash")
        assert not resends.lost_waiting and not lost.queued
    finally:
        loop.close()


def test_the_deadline_rule_never_expires_a_ticket_a_worker_holds() -> None:
    loop = asyncio.new_event_loop()
    try:
        now = 100.0
        ticket = _ticket(loop, 1)
        assert past_deadline(ticket, held=False, now=now) is Past.NOT_YET  # no deadline
        ticket.deadline = now + 1.0
        assert past_deadline(ticket, held=False, now=now) is Past.NOT_YET
        ticket.deadline = now  # passed (at its very instant)
        assert past_deadline(ticket, held=True, now=now) is Past.HELD  # answered, not 504
        assert past_deadline(ticket, held=False, now=now) is Past.EXPIRED
    finally:
        loop.close()

"""A suspect worker's tickets, as admission handles them (the real queue, hand-answered lanes):
their copies go by the ordinary rule beside new traffic, nothing stalls, each ticket is counted
once, the first answer wins, and queue time is counted per send.

A suspect lane is one with no room (as `Supervisor.has_room` says of a suspect worker); it keeps
what it holds, silent, until the test answers or crashes it."""

from __future__ import annotations

import asyncio
import time

from clef_dispatch.ticket import AdmissionEvents, Ticket
from clef_dispatch.worker_errors import WorkerExited
from tests.doubles import Admission, FakeLane, FakeWorkers, reply_of


def _counted(suspect: FakeLane, other: FakeLane, resent: list[str],
             expired: list[str]) -> Admission:
    """Admission over two lanes, its resends and expiries recorded (what the metrics count)."""
    return Admission(capacity=16, retry_after=1, workers=FakeWorkers(suspect, other),
                     events=AdmissionEvents(resent=resent.append, expired=expired.append))


def _deadline_passes(ticket: Ticket) -> None:
    """Time passes beyond the ticket's deadline (the clock is not the subject here: the rule
    that judges a passed deadline is)."""
    ticket.deadline = time.monotonic() - 1.0


def _copy_waiting_past_its_deadline() -> tuple[Admission, FakeLane, FakeLane, Ticket,
                                               list[str], list[str]]:
    """"a" on a worker that turns suspect while "b" fills the other one, so a's copy waits
    for room; then a's deadline passes, before the deadline timer looks (the pump finds it).
    Admission, the suspect and the busy lane, a's ticket, and the resends and expiries."""
    resent: list[str] = []
    expired: list[str] = []
    suspect, busy = FakeLane(room=1), FakeLane(room=1)
    admission = _counted(suspect, busy, resent, expired)
    ticket = admission.submit(b"a", deadline=time.monotonic() + 60.0)
    admission.submit(b"b")
    suspect.room = 0
    admission.lane_suspect(suspect, True)
    _deadline_passes(ticket)
    return admission, suspect, busy, ticket, resent, expired


def test_a_suspects_copies_and_new_requests_are_served_together() -> None:
    async def scenario() -> None:
        suspect, healthy = FakeLane(room=3), FakeLane(room=8)
        admission = Admission(capacity=16, retry_after=1, workers=FakeWorkers(suspect, healthy))
        held = [admission.submit(f"held{i}".encode()) for i in range(6)]  # 3 on each lane
        assert len(suspect.held) == 3 and len(healthy.held) == 3
        suspect.room = 0  # suspect: no new work, silent
        admission.lane_suspect(suspect, True)
        new = [admission.submit(f"new{i}".encode()) for i in range(2)]
        # All three copies and both new requests went to the healthy worker at once: nothing
        # waits for the copies to run one by one.
        assert healthy.sent == [b"held1", b"held3", b"held5", b"held0", b"held2", b"held4",
                                b"new0", b"new1"]
        assert admission.depth == 0
        assert admission.in_flight == 8  # each ticket once, copies or not
        while healthy.held:
            healthy.answer_oldest()
        for ticket in held + new:
            reply = await reply_of(ticket)
            assert reply.status == 200 and reply.body == ticket.body
        # The suspect answers late: dropped (the first answer won), and it is healthy again.
        suspect.room = 3
        admission.lane_suspect(suspect, False)
        while suspect.held:
            suspect.answer_oldest()
        assert admission.in_flight == 0 and admission.depth == 0
        await asyncio.wait_for(admission.wait_idle(), 1)

    asyncio.run(scenario())


def test_a_copy_waiting_for_room_is_counted_once_and_taken_back_when_the_suspect_answers(
) -> None:
    async def scenario() -> None:
        suspect, busy = FakeLane(room=1), FakeLane(room=1)
        admission = Admission(capacity=16, retry_after=1, workers=FakeWorkers(suspect, busy))
        first, second = admission.submit(b"a"), admission.submit(b"b")
        suspect.room = 0
        admission.lane_suspect(suspect, True)
        # The copy of "a" waits for room: the ticket is in flight, not also waiting.
        assert (admission.in_flight, admission.depth) == (2, 0)
        assert admission.tokens_waiting == 0
        third = admission.submit(b"c")
        assert (admission.in_flight, admission.depth) == (2, 1)
        suspect.room = 1
        admission.lane_suspect(suspect, False)  # answered again: its copy is taken back
        suspect.answer_oldest()
        busy.answer_oldest()
        for lane in (suspect, busy):
            while lane.held:
                lane.answer_oldest()
        assert (suspect.sent + busy.sent).count(b"a") == 1  # its copy never went anywhere
        assert [(await reply_of(t)).body for t in (first, second, third)] == [b"a", b"b", b"c"]

    asyncio.run(scenario())


def test_a_ticket_lost_with_both_workers_is_sent_again_alone() -> None:
    """A second loss still isolates a suspect's ticket: lost on the suspect and on the worker
    that ran its copy, it goes once more, alone, and a third loss is its 500."""
    async def scenario() -> None:
        suspect, other, spare = FakeLane(room=2), FakeLane(room=2), FakeLane(room=2)
        resent: list[str] = []
        admission = Admission(capacity=16, retry_after=1,
                              workers=FakeWorkers(suspect, other, spare),
                              events=AdmissionEvents(resent=resent.append))
        ticket = admission.submit(b"poison")
        suspect.room = 0
        admission.lane_suspect(suspect, True)
        assert other.sent == [b"poison"] and resent == ["suspect"]  # the copy went
        suspect.crash()  # one copy lost: the other is still due
        assert not ticket.outcome.done()
        other.ready = False
        held = other.held.pop(0)[1]
        held(WorkerExited("worker closed its output"))  # lost again: sent alone
        assert spare.sent == [b"poison"] and len(spare.held) == 1
        assert resent == ["suspect", "crash"]  # counted as it was sent again
        spare.held.pop(0)[1](WorkerExited("worker closed its output"))
        assert (await reply_of(ticket)).status == 500
        assert resent == ["suspect", "crash"]  # never a third send

    asyncio.run(scenario())


def test_queue_time_is_counted_per_send() -> None:
    """A ticket lost with its worker and sent again: its queue time is its waits, not its
    time on the lost worker."""
    async def scenario() -> None:
        lane = FakeLane(room=1)
        admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(lane))
        ticket = admission.submit(b"x")
        first_wait = ticket.queue_ms
        # A minute on the worker: every instant recorded so far moves a minute into the past.
        ticket.enqueued_at -= 60.0
        ticket.waiting_since -= 60.0
        ticket.started_at = (ticket.started_at or 0.0) - 60.0
        lane.held.pop(0)[1](WorkerExited("worker closed its output"))
        assert ticket.queue_ms < first_wait + 1000.0  # not the minute on the lost worker
        lane.answer_oldest()
        assert (await reply_of(ticket)).status == 200

    asyncio.run(scenario())


def test_a_copy_that_never_went_adds_no_queue_time() -> None:
    """A suspect's copy waits for room, then the suspect answers (taken back) or the ticket is
    answered by the suspect: the ticket was on a worker all along, so its queue time is its
    first wait alone, not the copy's time in the queue until the answer is logged."""
    async def scenario(answer_first: bool) -> None:
        suspect, busy = FakeLane(room=1), FakeLane(room=1)
        admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(suspect, busy))
        ticket, _other = admission.submit(b"a"), admission.submit(b"b")
        first_wait = ticket.queue_ms
        suspect.room = 0
        admission.lane_suspect(suspect, True)  # a copy of "a" waits: "busy" has no room
        if not answer_first:
            suspect.room = 1
            admission.lane_suspect(suspect, False)  # answered again: the copy is taken back
        suspect.answer_oldest()
        assert (await reply_of(ticket)).status == 200
        # A minute passes before the answer is logged: every recorded instant moves back.
        ticket.waiting_since -= 60.0
        assert ticket.queue_ms < first_wait + 1000.0
        assert busy.sent == [b"b"]  # the copy never went

    asyncio.run(scenario(answer_first=True))
    asyncio.run(scenario(answer_first=False))


def test_a_queued_copy_is_never_refused_and_becomes_the_resend_when_the_suspect_is_lost(
) -> None:
    """The suspect's copy waits (no room elsewhere): refusing the queue (the last worker lost,
    a drain cut short) leaves it, since its ticket is in flight; when the suspect is then lost,
    the copy becomes the ticket's one resend, alone, which waits through the restart."""
    async def scenario() -> None:
        suspect = FakeLane(room=1)
        admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(suspect))
        ticket = admission.submit(b"held")
        suspect.room = 0
        admission.lane_suspect(suspect, True)
        admission.refuse_waiting("worker is restarting", resent_too=False)
        assert not ticket.outcome.done()
        suspect.ready = False
        suspect.held.pop(0)[1](WorkerExited("worker closed its output"))
        admission.refuse_waiting("worker is restarting", resent_too=False)
        assert not ticket.outcome.done() and ticket.resent  # waits for the replacement
        suspect.ready, suspect.room = True, 1
        admission.lane_suspect(suspect, False)
        assert suspect.sent == [b"held", b"held"]
        suspect.answer_oldest()
        assert (await reply_of(ticket)).status == 200

    asyncio.run(scenario())


# -- the deadline rule: a ticket a worker holds is never expired ---------------------------------


def test_a_ticket_past_its_deadline_on_a_turning_suspect_gets_no_copy_and_its_own_answer(
) -> None:
    """A long forward outlives the request's deadline (its own, or `--queue-timeout` counted
    from admission), then its worker turns suspect: no copy is sent (nor counted), nothing is
    expired, and the suspect's answer is the client's 200."""
    async def scenario() -> None:
        resent: list[str] = []
        expired: list[str] = []
        suspect, healthy = FakeLane(room=2), FakeLane(room=2)
        admission = _counted(suspect, healthy, resent, expired)
        ticket = admission.submit(b"long", deadline=time.monotonic() + 60.0)
        assert suspect.sent == [b"long"]
        _deadline_passes(ticket)
        suspect.room = 0
        admission.lane_suspect(suspect, True)
        newer = admission.submit(b"new")  # new traffic flows on meanwhile
        assert healthy.sent == [b"new"]  # and no copy of "long" went
        assert (admission.depth, admission.in_flight) == (0, 2)
        assert not ticket.outcome.done()
        suspect.answer_oldest()
        healthy.answer_oldest()
        reply = await reply_of(ticket)
        assert (reply.status, reply.body) == (200, b"long")
        assert (await reply_of(newer)).status == 200
        assert resent == [] and expired == []

    asyncio.run(scenario())


def test_a_copy_whose_deadline_passes_while_it_waits_is_withdrawn_by_the_timer() -> None:
    """The copy waits for room; its deadline passes: the deadline timer takes the copy out of
    the queue (never sent, never counted as a resend), and the original's answer is the
    client's 200, not a 504."""
    async def scenario() -> None:
        resent: list[str] = []
        expired: list[str] = []
        suspect, busy = FakeLane(room=1), FakeLane(room=1)
        admission = _counted(suspect, busy, resent, expired)
        ticket = admission.submit(b"a", deadline=time.monotonic() + 0.05)
        other = admission.submit(b"b")
        suspect.room = 0
        admission.lane_suspect(suspect, True)  # the copy of "a" waits: "busy" has no room
        assert ticket.queued and ticket.copied
        fired = asyncio.Event()
        heap = admission._deadlines  # the timer, hooked for this test only
        after_due = heap._after_due

        def after_due_then_tell() -> None:
            after_due()
            fired.set()

        heap._after_due = after_due_then_tell
        await asyncio.wait_for(fired.wait(), 5.0)
        assert not ticket.queued and not ticket.outcome.done()  # withdrawn, not expired
        busy.answer_oldest()  # room: nothing of "a" goes there
        assert busy.sent == [b"b"]
        suspect.answer_oldest()
        assert [(await reply_of(t)).status for t in (ticket, other)] == [200, 200]
        assert resent == [] and expired == []

    asyncio.run(scenario())


def test_a_copy_found_past_its_deadline_by_the_pump_is_withdrawn_and_the_original_answers(
) -> None:
    async def scenario() -> None:
        admission, suspect, busy, ticket, resent, expired = _copy_waiting_past_its_deadline()
        busy.answer_oldest()
        assert busy.sent == [b"b"] and admission.depth == 0
        assert not ticket.outcome.done()
        suspect.answer_oldest()
        reply = await reply_of(ticket)
        assert (reply.status, reply.body) == (200, b"a")
        assert resent == [] and expired == []

    asyncio.run(scenario())


def test_a_ticket_no_worker_holds_is_expired_by_the_same_rule() -> None:
    """The other half of the rule: lost with its suspect worker past its deadline, the ticket
    is held by no worker any more, so it is answered 504 instead of being sent again."""
    async def scenario() -> None:
        _, suspect, busy, ticket, resent, expired = _copy_waiting_past_its_deadline()
        # Lost while its copy waited: that copy becomes its resend, which the pump finds past
        # its deadline with no worker holding it: 504, and never counted as sent again.
        suspect.held.pop(0)[1](WorkerExited("worker closed its output"))
        busy.answer_oldest()
        assert (await reply_of(ticket)).status == 504
        assert busy.sent == [b"b"]
        assert resent == [] and expired == ["interactive"]

    asyncio.run(scenario())


def test_a_suspect_resend_is_counted_only_when_its_copy_is_sent() -> None:
    async def scenario() -> None:
        resent: list[str] = []
        suspect, other = FakeLane(room=2), FakeLane(room=0)
        admission = _counted(suspect, other, resent, [])
        first, second = admission.submit(b"a"), admission.submit(b"b")
        suspect.room = 0
        admission.lane_suspect(suspect, True)  # two copies wait: no room anywhere
        assert resent == []
        other.room = 1
        other.answer_oldest() if other.held else admission.pump()  # room for one copy
        assert other.sent == [b"a"] and resent == ["suspect"]
        suspect.room = 2
        admission.lane_suspect(suspect, False)  # the other copy is taken back, unsent
        for lane in (suspect, other):
            while lane.held:
                lane.answer_oldest()
        assert [(await reply_of(t)).status for t in (first, second)] == [200, 200]
        assert resent == ["suspect"]

    asyncio.run(scenario())

"""Second sends: what admission does when a worker is lost or suspect, apart from the queue.

No request lost to a worker's death: an answer is a pure function of the request, so tickets in
flight on a worker that is lost (`WorkerLost`: died, stalled, hung, broke the protocol) are sent
again, once, before anything else, each alone on an idle worker. A poison request thus kills at
most two workers (the one it shared, the one it ran alone on) and gets a 500; its companions are
answered. While a resent ticket waits for an idle worker nothing new is sent, so one drains;
one for a model no ready worker serves any more is answered instead (admission's pump).
Resent tickets also wait through a restart of the last worker (bounded by their deadline, or
`resend_timeout`).

A suspect worker (clef_dispatch/liveness.py: its pong or reply is overdue) is not lost yet, and
nothing stalls for it: each ticket it holds gets one copy, queued at the head of its class and
sent by admission's ordinary rule to the next worker with room, beside new traffic, while its own
copy stays in flight (the ticket counts once, in flight: clef_dispatch/waiting.py). The first
answer wins and the other is dropped, so every client gets exactly one answer; a copy that fails
while another is in flight or queued is forgotten, and a ticket lost with both workers is sent
again alone, as any lost ticket (a poison request is still isolated). A suspect that answers
again takes back the copies still queued. A ticket past its deadline gets no copy, and a copy
whose deadline passes while it waits is withdrawn (admission's deadline rule: a ticket a worker
holds is never expired). A resend is counted when it is really sent (`sent_again`), never when
merely queued.

`Resends` owns the state of those rules (the lost tickets waiting, the copies queued, the lanes
running a ticket alone) and `judge` says what a worker's outcome means for a ticket; admission
(clef_dispatch/admission.py) keeps the class queues, the tickets in flight and the sending.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from clef_dispatch.ticket import AdmissionEvents, Lane, Ticket
from clef_dispatch.waiting import TicketQueue
from clef_dispatch.worker_errors import WorkerFailure, WorkerLost, WorkerOutcome

log = logging.getLogger("clef_dispatch.resend")


class Verdict(enum.Enum):
    """What a worker's outcome does to its ticket (`judge`)."""

    LATE = "late"  # the ticket is already answered (by its other copy): drop this one
    RESEND = "resend"  # lost with its worker, never resent yet: send again, alone
    RESEND_COPY = "resend_copy"  # lost with a suspect before its queued copy went: that copy
    # becomes the ticket's one resend, alone
    OTHER_DUE = "other_due"  # this copy failed, the other is in flight or queued: forget it
    FAILED = "failed"  # failed for good: 500
    ANSWERED = "answered"  # a reply: the client's answer


def judge(ticket: Ticket, outcome: WorkerOutcome, *, in_flight_elsewhere: bool,
          lost_waiting: bool, copy_queued: bool) -> Verdict:
    """What `outcome` (from one worker, whose copy is already forgotten) means for `ticket`.

    `in_flight_elsewhere`: another copy is on a worker; `lost_waiting`: the ticket waits to be
    resent; `copy_queued`: a suspect's copy of it waits in its class queue.
    """
    if ticket.outcome.done():
        return Verdict.LATE
    if (isinstance(outcome, WorkerLost) and not ticket.resent and copy_queued
            and not in_flight_elsewhere):
        return Verdict.RESEND_COPY
    if isinstance(outcome, WorkerFailure) and (in_flight_elsewhere or lost_waiting
                                               or copy_queued):
        return Verdict.OTHER_DUE
    if isinstance(outcome, WorkerLost) and not ticket.resent:
        return Verdict.RESEND
    if isinstance(outcome, WorkerFailure):
        return Verdict.FAILED
    return Verdict.ANSWERED


class Resends:
    """The lost tickets waiting to go again, the suspects' queued copies, the lanes alone.

    `keep_deadline` is admission's: a resent ticket waits under the same deadline timer as
    any other. Admission recounts (waiting.Counts) every ticket these methods move.
    """

    def __init__(self, *, events: AdmissionEvents, resend_timeout: float,
                 keep_deadline: Callable[[Ticket], None]) -> None:
        self._events = events
        self._resend_timeout = resend_timeout
        self._keep_deadline = keep_deadline
        self._lost = TicketQueue()  # lost with their worker: next, each alone
        # Copies of a suspect worker's tickets, queued at the head of their class while the
        # original is still in flight (counted there, not as waiting).
        self._copies: set[Ticket] = set()
        self._alone: dict[Lane, Ticket] = {}  # lanes running a resent ticket, and which
        self._lost_why: dict[Ticket, str] = {}  # why each lost ticket waiting was lost

    # Loop-side only: the gauges read admission's counts (waiting.Counts), never these.

    @property
    def lanes_alone(self) -> Mapping[Lane, Ticket]:
        """Lanes running a resent ticket alone: nothing else goes to them meanwhile."""
        return self._alone

    @property
    def lost_waiting(self) -> bool:
        """Whether a lost ticket waits to be sent again (admission sends nothing new then)."""
        return bool(self._lost)

    def is_copy(self, ticket: Ticket) -> bool:
        """Whether `ticket` is in a class queue as a suspect's copy."""
        return ticket in self._copies

    def is_lost_waiting(self, ticket: Ticket) -> bool:
        return ticket in self._lost

    def copy(self, held: Iterable[Ticket], waiting: Mapping[str, TicketQueue]) -> None:
        """A worker became suspect holding `held` (oldest first, none past its deadline): each
        gets one copy, queued at the head of its class in `waiting` (the oldest first in line).
        The resend is counted (`resent_total{reason="suspect"}`) only when a copy is sent: one
        taken back or withdrawn unsent was never a second send."""
        for ticket in reversed(list(held)):
            if not ticket.copied and not ticket.outcome.done():
                log.warning("frame_id=%d request_id=%s held by a suspect worker: a copy "
                            "goes to another worker (the first answer wins)",
                            ticket.frame_id, ticket.request_id)
                ticket.copied = True
                ticket.wait_again()
                self._copies.add(ticket)
                waiting[ticket.priority].appendleft(ticket)
                self._keep_deadline(ticket)  # withdrawn unsent if it passes (admission)

    def to_take_back(self, held: Iterable[Ticket]) -> list[Ticket]:
        """A suspect answered again: those of `held` whose copy still waits (admission takes
        them out of the queue); they may be copied again if it falls silent again."""
        back = [ticket for ticket in held if ticket in self._copies]
        for ticket in back:
            ticket.copied = False
        return back

    def leaving_queue(self, ticket: Ticket) -> None:
        """`ticket` leaves its class queue (sent, or taken out): it is no longer a queued copy."""
        self._copies.discard(ticket)

    def unqueue_lost(self, ticket: Ticket) -> bool:
        """Take `ticket` out of the lost tickets waiting; False if it was not there."""
        self._lost_why.pop(ticket, None)
        return self._lost.remove(ticket)

    def lose(self, ticket: Ticket, failure: WorkerLost) -> None:
        """Queue a ticket lost with its worker to be sent again, alone, before anything else:
        the once it may be."""
        log.warning("frame_id=%d request_id=%s lost with its worker (%s): sending it again, "
                    "alone", ticket.frame_id, ticket.request_id, failure)
        ticket.started_at = None  # waiting again
        ticket.wait_again()
        self._lost_why[ticket] = failure.reason  # counted once it is really sent again
        ticket.resent = True
        if ticket.deadline is None:  # bounded even while the last worker is replaced
            ticket.deadline = time.monotonic() + self._resend_timeout
        self._lost.append(ticket)
        self._keep_deadline(ticket)

    def next_lost_model(self) -> str:
        """The model of the lost ticket `pop_lost` takes next (it goes only to a worker that
        serves it)."""
        return next(iter(self._lost)).model if self._lost else ""

    def pop_lost(self) -> tuple[Ticket, str]:
        """The oldest lost ticket waiting, taken out to be sent alone (`lost_waiting` first),
        and why it was lost (for `sent_again`)."""
        ticket = self._lost.popleft()
        return ticket, self._lost_why.pop(ticket, "")

    def sent_again(self, reason: str) -> None:
        """A lost ticket (`reason`: why it was lost) or a suspect's copy (`"suspect"`) was
        really sent again: the one place a resend is counted, so one withdrawn, expired or
        taken back unsent never is (`clef_requests_resent_total` counts sends)."""
        self._events.resent(reason)

    def drop_answered(self) -> list[Ticket]:
        """Forget lost tickets already settled (answered elsewhere, or their client left);
        return those dropped."""
        return self._forget_why(self._lost.take(_answered))

    def take_all_lost(self) -> list[Ticket]:
        """Every lost ticket waiting, taken out (to be refused)."""
        return self._forget_why(self._lost.take(_every))

    def _forget_why(self, tickets: list[Ticket]) -> list[Ticket]:
        for ticket in tickets:
            self._lost_why.pop(ticket, None)
        return tickets

    def running_alone(self, lane: Lane, ticket: Ticket) -> None:
        self._alone[lane] = ticket

    def finished_on(self, lane: Lane, ticket: Ticket) -> None:
        """`ticket`'s copy on `lane` is answered, failed or never sent: the lane is free."""
        if self._alone.get(lane) is ticket:
            del self._alone[lane]


def _answered(ticket: Ticket) -> bool:
    return ticket.outcome.done()


def _every(_: Ticket) -> bool:
    return True

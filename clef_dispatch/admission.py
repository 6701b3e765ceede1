"""Admission: requests go to the workers by class and arrival order, the rest wait.

Why a queue and not a "busy" refusal: each worker runs its model on one thread (one CUDA
context, no per-thread cost), so concurrency belongs in front of it, not in it. Each worker (a
`Lane`) may hold up to its `max_batch` requests at once, which it batches into one forward; a
request goes to a worker with room (first the one whose prefix cache may hold its state,
affinity.py; else the next one, round robin), and waits in the queue only while none has room. A
request is refused (503 with Retry-After) only when the queue is full, no worker is warm, or the
server is draining. A ticket whose client has gone is taken out of the queue and never reaches a
worker (checked again right before its frame is written); once a ticket is in flight its reply
is always read (the channel matches replies by id), so a reply can never be mistaken for
someone else's.

Shared traffic (priority.py names the classes): waiting `interactive` tickets go before waiting
`bulk` ones, FIFO within a class, except that one admission in every `BULK_EVERY` goes to bulk
while both wait, so bulk never starves. A ticket may carry a deadline (`X-Clef-Deadline-Ms`,
`--queue-timeout`): one timer, aimed at the earliest, answers a ticket still waiting at its
deadline with 504, and it never reaches a worker; one rule (deadline_heap.past_deadline) judges
a passed deadline wherever it is found: a ticket a worker holds is never expired.

Lost and suspect workers (clef_dispatch/resend.py owns those rules): a ticket in flight on a
worker that is lost is sent again, once, before anything else, alone on an idle worker; while it
waits for one nothing new is sent. The dispatch never waits on one request, though: a ticket
whose model no ready worker serves (a variant removed while it was on the lost worker) is
answered at once (`routing.no_worker_for`), and when a waiting ticket's deadline passes the
dispatch runs again, so whatever it held back is sent. New tickets get 503 while no worker is
ready (unless `wait_for_workers`: clef-batch's lines wait for a replacement rather than be
answered 503). A suspect worker's tickets each get one copy, queued at the head of their class
and sent by the ordinary rule below beside new traffic; the first answer wins.

Admission knows the workers only through the `Workers` and `Lane` protocols below and tells a
503 from a 500 by the exceptions of `worker_errors`; it never imports the supervisor, the pool
or the channel, so they can change shape behind it.

Load in tokens (load.py: each answer teaches the estimate its real token count) and the counts
the gauges read from the metrics thread (waiting.py: plain ints, each ticket counted once, a
suspect's queued copy included) are kept as tickets move.

Everything here is driven by events and runs no task of its own: a ticket is sent the moment it
is admitted if a worker has room, and each reply (a callback from the worker channel) answers
its ticket and sends the next waiting one. No dispatcher task, no task per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from clef_dispatch.deadline_heap import DeadlineHeap, Past, past_deadline
from clef_dispatch.load import TokenEstimate
from clef_dispatch.outcomes import EXPIRED_DETAIL, Answer, Refusal, RefusalKind
from clef_dispatch.resend import Resends, Verdict, judge
from clef_dispatch.routing import WorkerChoice, no_worker_for, refuse, unserved
from clef_dispatch.ticket import (
    AdmissionEvents,
    Lane,
    LaneRing,
    Ticket,
    Workers,
    never_gone,
)
from clef_dispatch.urgency import BULK, CLASSES, INTERACTIVE, earliest
from clef_dispatch.waiting import CountReads, Counts, TicketQueue
from clef_dispatch.worker_errors import WorkerFailure, WorkerLost, WorkerOutcome, WorkerUnavailable
from clef_protocol.messages import INFERENCE_FAILED, Request
from clef_protocol.options import RequestLimits

log = logging.getLogger("clef_dispatch.admission")

# While both classes wait, one admission in this many goes to the oldest bulk ticket: an
# interactive request waits behind at most one bulk request per BULK_EVERY - 1 interactive ones,
# and a bulk flood still moves at 1/BULK_EVERY of the workers under sustained interactive load.
BULK_EVERY = 8


class Admission(CountReads):
    """The queue, and the hand-over of each ticket to the next worker with room (the gauges'
    reads of its counts are `waiting.CountReads`)."""

    def __init__(self, *, capacity: int, retry_after: int, workers: Workers,
                 queue_timeout: float | None = None, resend_timeout: float = 300.0,
                 events: AdmissionEvents | None = None, wait_for_workers: bool = False,
                 estimate: TokenEstimate | None = None) -> None:
        self._capacity = capacity
        self._wait_for_workers = wait_for_workers
        self._retry_after = retry_after
        self._workers = workers
        self._queue_timeout = queue_timeout
        self._events = events or AdmissionEvents()
        self._waiting: dict[str, TicketQueue] = {name: TicketQueue() for name in CLASSES}
        self._counts = Counts()  # what the gauges read (waiting.py); settled by `_settle`
        self._resends = Resends(events=self._events, resend_timeout=resend_timeout,
                                keep_deadline=self._keep_deadline)
        self._sent: dict[Ticket, list[Lane]] = {}  # in flight, oldest first; on which lanes
        self._choice = WorkerChoice(workers, LaneRing(workers),
                                    lambda: self._resends.lanes_alone)
        self._turn = 0  # admissions made while both classes waited (see BULK_EVERY)
        self._ids = itertools.count(1)
        # Once deadlines passed the dispatch runs: a ticket that expired may have held the
        # others back (a lost one waiting for an idle worker).
        self._deadlines = DeadlineHeap(self._deadline_passed, self.pump)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._estimate = estimate or TokenEstimate(RequestLimits().max_length)

    @property
    def draining(self) -> bool:
        """True once `start_draining` was called: the one copy of the server's drain state."""
        return self._draining

    @property
    def in_flight(self) -> int:
        """Tickets sent to a worker and not yet answered, over all workers."""
        return len(self._sent)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_flight_since(self) -> float | None:
        """`time.monotonic()` at which the oldest request now in flight was sent (None: idle)."""
        oldest = next(iter(list(self._sent)), None)
        return oldest.started_at if oldest is not None else None

    def submit(self, body: bytes, request_id: str = "", *, trace_id: str = "",
               priority: str = INTERACTIVE, deadline: float | None = None,
               gone: Callable[[], bool] = never_gone,
               affinity: bytes | None = None, model: str = "") -> Ticket | Refusal:
        """Admit a checked body (sent at once if a worker has room), or refuse it
        (UNAVAILABLE: draining, no ready worker (serving its `model`), or the queue is full).

        A ticket whose deadline has already passed is answered 504 at once. `affinity` is the
        request's prefix key (affinity.prefix_key): the worker whose cache may hold its state
        is preferred while it has room.
        """
        reason = "server is draining" if self._draining else self._workers.unavailable_reason()
        if reason is not None and self._wait_for_workers and not self._draining:
            reason = None
        if reason is None and unserved(model, self._workers):
            return no_worker_for(model, self._workers, self._retry_after)
        lane = None
        if reason is None and not self._queued() and not self._resends.lost_waiting:
            lane = self._choice.lane_for(affinity, model)
        if reason is None and lane is None and self.depth >= self._capacity:
            reason = "queue is full"
        if reason is not None:
            return self._unavailable(reason)
        now = time.monotonic()
        ticket = Ticket(next(self._ids), body, asyncio.get_running_loop().create_future(),
                        request_id, trace_id, priority,
                        earliest(deadline, now, self._queue_timeout), gone,
                        enqueued_at=now, tokens=self._estimate.cost(len(body)),
                        affinity=affinity, model=model)
        if self._past_deadline(ticket):  # already passed: answered 504 at once
            return ticket
        self._idle.clear()
        if lane is not None:
            self._send(ticket, lane)
        else:
            self._wait(ticket)
        return ticket

    def abandon(self, ticket: Ticket) -> None:
        """The client has gone: drop the ticket if it still waits; if in flight, let it finish."""
        if self._unqueue(ticket):
            self._settle(ticket)
            log.info("frame_id=%d request_id=%s dropped from the queue: client gone",
                     ticket.frame_id, ticket.request_id)
            self._update_idle()
        if not ticket.outcome.done():
            ticket.outcome.cancel()

    def refuse_waiting(self, reason: str, *, resent_too: bool = True) -> None:
        """Answer every waiting ticket with 503 (no worker is left, or the drain timed out).

        With `resent_too=False` (the last worker was lost and is being replaced) resent tickets
        keep waiting for the replacement: they were admitted while a worker was ready. A
        suspect's queued copy is never refused while its ticket is in flight (it is answered
        there); once no worker holds the ticket its copy is its second send, kept or refused
        with the resent tickets.
        """
        def leaves(ticket: Ticket) -> bool:
            if not self._resends.is_copy(ticket):
                return True
            return resent_too and ticket not in self._sent

        refused: list[Ticket] = []
        for queue in self._waiting.values():
            refused.extend(queue.take(leaves))
        if resent_too:
            refused.extend(self._resends.take_all_lost())
        for ticket in refused:
            self._resends.leaving_queue(ticket)
            self._settle(ticket)
            if not ticket.outcome.done():
                ticket.outcome.set_result(self._unavailable(reason))
        self._update_idle()

    def start_draining(self) -> None:
        """Refuse new requests; what is queued still runs."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once nothing waits and nothing is in flight."""
        await self._idle.wait()

    def lane_suspect(self, lane: Lane, suspect: bool) -> None:
        """A worker became suspect (True) or answered again (False); see resend.py.

        Suspect: each ticket it holds gets a copy queued at the head of its class (once), sent
        by the ordinary rule to the next worker with room; new traffic flows on meanwhile.
        Healthy again: copies still queued (not sent elsewhere) are taken back.
        """
        mine = [ticket for ticket, lanes in self._sent.items() if lane in lanes]
        if suspect:
            # Past its deadline a ticket gets no copy: the suspect's own answer is awaited.
            self._resends.copy([ticket for ticket in mine if not self._past_deadline(ticket)],
                               self._waiting)
        else:
            for ticket in self._resends.to_take_back(mine):
                self._unqueue(ticket)
                ticket.copy_withdrawn()
        for ticket in mine:
            self._settle(ticket)  # in flight all along: counted there, copy or not
        self.pump()

    def pump(self) -> None:
        """Send waiting tickets while some worker has room: resent ones first, each alone on an
        idle worker; then by class (see BULK_EVERY), oldest first within a class. A ticket
        whose model no ready worker serves, while some worker is ready, is answered at once
        (`routing.no_worker_for`: 503, or 404 once no worker lists the model), never waited
        on: the dispatch never waits on one request.

        Called after every reply, whenever a worker becomes ready, and after deadlines pass.
        """
        for ticket in self._resends.drop_answered():
            self._settle(ticket)
        while self._resends.lost_waiting:
            model = self._resends.next_lost_model()
            unservable = self._unservable(model)
            lane = None if unservable else self._choice.idle_lane(model)
            if lane is None and not unservable:
                break
            ticket, why = self._resends.pop_lost()
            if lane is None:
                log.warning("frame_id=%d request_id=%s lost with its worker, for model %r "
                            "that no ready worker serves: answered, not sent again",
                            ticket.frame_id, ticket.request_id, model)
                refuse(ticket, False, no_worker_for(model, self._workers, self._retry_after))
                self._settle(ticket)
            elif not self._still_wanted(ticket):
                self._settle(ticket)
            elif self._send(ticket, lane, alone=True):
                self._resends.sent_again(why)
        if not self._resends.lost_waiting:  # a lost ticket waiting for an idle worker holds
            while self._queued() and self._choice.room_somewhere():  # the rest back
                head = self._next_waiting(take=False)  # only to workers serving its model:
                lane = self._choice.lane_for(head.affinity, head.model)  # if none ready does,
                if lane is None and not self._unservable(head.model):  # it is answered
                    break
                ticket = self._next_waiting()
                copy = self._resends.is_copy(ticket)
                self._resends.leaving_queue(ticket)
                if lane is None:
                    refuse(ticket, ticket in self._sent,
                           no_worker_for(ticket.model, self._workers, self._retry_after))
                if lane is None or not self._still_wanted(ticket):
                    self._settle(ticket)
                elif self._send(ticket, lane) and copy:
                    self._resends.sent_again("suspect")
        self._update_idle()

    def takes_now(self, model: str) -> bool:
        """Whether a request for `model` admitted now would be sent to a worker at once
        (nothing waits ahead of it and a worker serving it has room): answer sharing asks
        before a request with its own deadline waits on another's forward."""
        return (not self._draining and self._workers.unavailable_reason() is None
                and not self._queued() and not self._resends.lost_waiting
                and self._choice.takes_now(model))

    # -- internals ---------------------------------------------------------------------------

    def _wait(self, ticket: Ticket) -> None:
        """Queue a ticket (in its class) and keep its deadline."""
        self._waiting[ticket.priority].append(ticket)
        self._settle(ticket)
        self._keep_deadline(ticket)

    def _keep_deadline(self, ticket: Ticket) -> None:
        self._deadlines.add(ticket, self.depth)

    def _deadline_passed(self, ticket: Ticket) -> None:
        """The timer: a kept deadline passed; judged if the ticket (or its copy) still waits."""
        if ticket.queued and not ticket.outcome.done():
            self._past_deadline(ticket)
        self._settle(ticket)

    def _past_deadline(self, ticket: Ticket) -> bool:
        """Whether `ticket`'s deadline has passed, applying the one deadline rule
        (deadline_heap.past_deadline) if so; the caller settles the ticket's count."""
        past = past_deadline(ticket, held=ticket in self._sent, now=time.monotonic())
        if past is Past.HELD:  # on a worker: never expired
            if self._unqueue(ticket) or ticket.copied:
                ticket.copy_withdrawn()
            log.info("frame_id=%d request_id=%s: deadline passed while a worker holds it: no "
                     "copy sent, its answer is awaited", ticket.frame_id, ticket.request_id)
        elif past is Past.EXPIRED:
            self._unqueue(ticket)
            log.info("frame_id=%d request_id=%s class=%s: deadline passed after %.0f ms "
                     "waiting, not sent", ticket.frame_id, ticket.request_id, ticket.priority,
                     ticket.queue_ms)
            self._events.expired(ticket.priority)
            if not ticket.outcome.done():
                ticket.outcome.set_result(Refusal(RefusalKind.EXPIRED, EXPIRED_DETAIL))
        return past is not Past.NOT_YET

    def _unservable(self, model: str) -> bool:
        """A variant no ready worker serves while some worker is ready: a ticket for it is
        answered rather than waited on (with no worker ready at all, everything waits for the
        replacement, as resent tickets do)."""
        return self._workers.unavailable_reason() is None and unserved(model, self._workers)

    def _unqueue(self, ticket: Ticket) -> bool:
        """Take a waiting ticket (or a queued copy) out of its queue; False if none waited.

        The caller settles the ticket's count once its change is complete (`_settle`)."""
        self._resends.leaving_queue(ticket)
        return (self._waiting[ticket.priority].remove(ticket)
                or self._resends.unqueue_lost(ticket))

    def _queued(self) -> bool:
        """Whether a ticket or a copy waits in a class queue."""
        return any(self._waiting.values())

    def _next_waiting(self, take: bool = True) -> Ticket:
        """The next ticket to send: interactive first, one in BULK_EVERY bulk while both wait
        (with `take` False: the one that would be taken, left in its queue)."""
        interactive, bulk = self._waiting[INTERACTIVE], self._waiting[BULK]
        queue = interactive or bulk
        if interactive and bulk:
            turn = self._turn + 1
            self._turn = turn if take else self._turn
            queue = bulk if turn % BULK_EVERY == 0 else interactive
        return queue.popleft() if take else next(iter(queue))

    def _still_wanted(self, ticket: Ticket) -> bool:
        """Right before the frame: a ticket whose client left is dropped, and one whose deadline
        passed is judged by the deadline rule (`_past_deadline`), instead of being sent."""
        if ticket.outcome.done():
            return False
        if ticket.gone():
            log.info("frame_id=%d request_id=%s not sent: client gone", ticket.frame_id,
                     ticket.request_id)
            ticket.outcome.cancel()
            return False
        return not self._past_deadline(ticket)

    def _send(self, ticket: Ticket, lane: Lane, *, alone: bool = False) -> bool:
        """Send `ticket` to `lane`; False if the worker refused it (nothing was sent)."""
        ticket.sent(time.monotonic())
        ticket.weights = lane.weights_of(ticket.model)
        self._sent.setdefault(ticket, []).append(lane)
        self._settle(ticket)  # from its queue to the worker in one step
        if alone:
            self._resends.running_alone(lane, ticket)
        try:
            lane.submit(Request(ticket.frame_id, ticket.body, ticket.request_id, ticket.trace_id),
                        lambda outcome: self._done(ticket, lane, outcome))
        except WorkerUnavailable as exc:  # has_room said yes; nothing was sent
            self._forget_copy(ticket, lane)
            self._settle(ticket)
            if not ticket.outcome.done() and ticket not in self._sent:
                ticket.outcome.set_result(self._unavailable(str(exc)))
            return False
        return True

    def _done(self, ticket: Ticket, lane: Lane, outcome: WorkerOutcome) -> None:
        """A worker answered the ticket (or failed with it in flight): reply, send the next.

        With two copies (one on a suspect worker) the first answer wins: a later one is dropped,
        and a failure is forgotten while the other copy is in flight or queued to be sent.
        """
        self._forget_copy(ticket, lane)
        verdict = judge(ticket, outcome, in_flight_elsewhere=ticket in self._sent,
                        lost_waiting=self._resends.is_lost_waiting(ticket),
                        copy_queued=self._resends.is_copy(ticket))
        if verdict is Verdict.LATE:
            if not isinstance(outcome, WorkerFailure) and (ticket.resent or ticket.copied):
                log.info("frame_id=%d request_id=%s answered again by a second worker: the "
                         "later answer is dropped", ticket.frame_id, ticket.request_id)
        elif verdict is Verdict.RESEND_COPY and isinstance(outcome, WorkerLost):
            self._unqueue(ticket)  # lost with the suspect before its copy went: sent alone
            self._resends.lose(ticket, outcome)
        elif verdict is Verdict.OTHER_DUE:
            log.info("frame_id=%d request_id=%s: one copy failed (%s), the other is still due",
                     ticket.frame_id, ticket.request_id, outcome)
        elif verdict is Verdict.RESEND and isinstance(outcome, WorkerLost):
            self._resends.lose(ticket, outcome)
        elif isinstance(outcome, WorkerFailure):  # Verdict.FAILED
            log.error("frame_id=%d request_id=%s failed: %s", ticket.frame_id,
                      ticket.request_id, outcome)
            ticket.outcome.set_result(Refusal(RefusalKind.FAILED, INFERENCE_FAILED))
        else:  # Verdict.ANSWERED
            ticket.worker_ms = outcome.worker_ms
            ticket.worker_reply = outcome
            if outcome.body is not None:
                self._estimate.learn(len(ticket.body),
                                     outcome.input_tokens + outcome.truncated_tokens)
            ticket.outcome.set_result(Answer(outcome))
        if ticket.outcome.done() and self._resends.is_copy(ticket):
            self._unqueue(ticket)  # answered: its queued copy waits for nothing now
            ticket.copy_withdrawn()
        self._settle(ticket)
        self.pump()

    def _forget_copy(self, ticket: Ticket, lane: Lane) -> None:
        """The copy of `ticket` on `lane` is answered, failed, or was never sent."""
        lanes = self._sent.get(ticket)
        if lanes is not None and lane in lanes:
            lanes.remove(lane)
            if not lanes:
                del self._sent[ticket]
        self._resends.finished_on(lane, ticket)

    def _settle(self, ticket: Ticket) -> None:
        """Recount `ticket` where it now is (waiting.Counts: the gauges' ints), once the change
        that moved it is complete, so no read sees it in two places or in none."""
        self._counts.settle(ticket, in_flight=ticket in self._sent)

    def _unavailable(self, reason: str) -> Refusal:
        return Refusal(RefusalKind.UNAVAILABLE, reason, self._retry_after)

    def _update_idle(self) -> None:
        if not self.depth and not self._sent:
            self._idle.set()
        else:
            self._idle.clear()

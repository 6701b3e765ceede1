"""Admission: requests go to the workers by class and arrival order, the rest wait.

Why a queue and not a "busy" refusal: each worker runs its model on one thread (one CUDA
context, no per-thread cost), so concurrency belongs in front of it, not in it. Each worker (a
`Lane`) may hold up to its `max_batch` requests at once, which it batches into one forward; a
request goes to the next worker with room, and waits in the queue only while none has room. A
request is refused (503 with Retry-After) only when the queue is full, no worker is warm, or the
server is draining. A ticket whose client has gone is taken out of the queue and never reaches a
worker (checked again right before its frame is written); once a ticket is in flight its reply
is always read (the channel matches replies by id), so a reply can never be mistaken for
someone else's.

Shared traffic (priority.py names the classes): waiting `interactive` tickets go before waiting
`bulk` ones, FIFO within a class, except that one admission in every `BULK_EVERY` goes to bulk
while both wait, so bulk never starves. A ticket may carry a deadline (`X-Clef-Deadline-Ms`,
`--queue-timeout`): one timer, aimed at the earliest, answers a ticket still waiting at its
deadline with 504, and it never reaches a worker.

No request lost to a worker's death: an answer is a pure function of the request, so tickets in
flight on a worker that is lost (`WorkerLost`: died, stalled, hung, broke the protocol) are sent
again, once, before anything else, each alone on an idle worker. A poison request thus kills at
most two workers (the one it shared, the one it ran alone on) and gets a 500; its companions are
answered. While a resent ticket waits for an idle worker nothing new is sent, so one drains.
Resent tickets also wait through a restart of the last worker (bounded by their deadline, or
`resend_timeout`), where new tickets would get 503 (unless `wait_for_workers`: clef-batch's
lines wait for a replacement rather than be answered 503).

A suspect worker (`lane_suspect`, from clef_dispatch/liveness.py: its pong or reply is overdue) is
not lost yet, and nothing stalls for it: each ticket it holds gets one copy, queued at the head of
its class and sent by the ordinary rule to the next worker with room, beside new traffic, while
its own copy stays in flight (counted once: in flight). The first answer wins and the other is
dropped, so every client gets exactly one answer; a copy that fails while another is in flight
or queued is forgotten, and a ticket lost with both workers is sent again alone, as any lost
ticket (a poison request is still isolated). A suspect that answers again takes back the copies
still queued. With one worker the copies simply wait for its answer or its replacement.

Admission knows the workers only through the `Workers` and `Lane` protocols below and tells a
503 from a 500 by the exceptions of `worker_errors`; it never imports the supervisor, the pool
or the channel, so they can change shape behind it.

Load in tokens (load.py): each ticket carries its estimated token cost, and admission keeps the
sum waiting and the sum in flight (summed when read), the numerator of the utilisation gauge an
endpoint picker reads; each answer teaches the estimate its real token count.

Everything here is driven by events and runs no task of its own: a ticket is sent the moment it
is admitted if a worker has room, and each reply (a callback from the worker channel) answers
its ticket and sends the next waiting one. No dispatcher task, no task per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from clef_dispatch.deadline_heap import DeadlineHeap
from clef_dispatch.load import TokenEstimate
from clef_dispatch.outcomes import (
    EXPIRED_DETAIL,
    Answer,
    Refusal,
    RefusalKind,
)
from clef_dispatch.ticket import (
    AdmissionEvents,
    Lane,
    LaneRing,
    Ticket,
    Workers,
    has_room,
    is_idle,
    never_gone,
)
from clef_dispatch.urgency import BULK, CLASSES, INTERACTIVE, earliest
from clef_dispatch.worker_errors import (
    WorkerFailure,
    WorkerLost,
    WorkerOutcome,
    WorkerUnavailable,
)
from clef_protocol.messages import INFERENCE_FAILED, Request
from clef_protocol.options import RequestLimits

log = logging.getLogger("clef_dispatch.admission")

# While both classes wait, one admission in this many goes to the oldest bulk ticket: an
# interactive request waits behind at most one bulk request per BULK_EVERY - 1 interactive ones,
# and a bulk flood still moves at 1/BULK_EVERY of the workers under sustained interactive load.
BULK_EVERY = 8


class Admission:
    """The queue, and the hand-over of each ticket to the next worker with room."""

    def __init__(self, *, capacity: int, retry_after: int, workers: Workers,
                 queue_timeout: float | None = None, resend_timeout: float = 300.0,
                 events: AdmissionEvents | None = None, wait_for_workers: bool = False,
                 estimate: TokenEstimate | None = None) -> None:
        self._capacity = capacity
        self._wait_for_workers = wait_for_workers
        self._retry_after = retry_after
        self._workers = workers
        self._queue_timeout = queue_timeout
        self._resend_timeout = resend_timeout
        self._events = events or AdmissionEvents()
        self._waiting: dict[str, deque[Ticket]] = {name: deque() for name in CLASSES}
        self._resend: deque[Ticket] = deque()  # lost with their worker: next, each alone
        # Copies of a suspect worker's tickets, queued at the head of their class while the
        # original is still in flight (counted there, not here).
        self._copies: set[Ticket] = set()
        self._alone: dict[Lane, Ticket] = {}  # lanes running a resent ticket, and which
        self._sent: dict[Ticket, list[Lane]] = {}  # in flight, oldest first; on which lanes
        self._ring = LaneRing(workers)
        self._turn = 0  # admissions made while both classes waited (see BULK_EVERY)
        self._ids = itertools.count(1)
        self._deadlines = DeadlineHeap(self._deadline_passed, self._update_idle)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._estimate = estimate or TokenEstimate(RequestLimits().max_length)

    # The gauges' reads may run on the metrics port's thread while the loop changes the queues:
    # each walks a `list(...)` copy, taken in one C call (never a live deque, set or dict), so a
    # scrape never sees a container change under it. Each ticket counts once: a suspect's
    # ticket whose copy waits is in flight, not waiting (clef_dispatch/liveness.py).

    @property
    def tokens_waiting(self) -> int:
        """Estimated tokens of the tickets waiting (resent ones included)."""
        queues = [list(queue) for queue in list(self._waiting.values())]
        copies = set(list(self._copies))
        return (sum(t.tokens for queue in queues for t in queue if t not in copies)
                + sum(t.tokens for t in list(self._resend)))

    @property
    def tokens_in_flight(self) -> int:
        """Estimated tokens of the tickets sent to a worker and not yet answered."""
        return sum(t.tokens for t in list(self._sent))

    @property
    def depth(self) -> int:
        """Tickets waiting (not counting those in flight)."""
        # map, not a generator: asked several times a request
        return (sum(map(len, list(self._waiting.values()))) + len(self._resend)
                - len(self._copies))

    def depth_of(self, priority: str) -> int:
        """Tickets of one class waiting (a resent ticket counts in its class)."""
        return (len(self._waiting[priority])
                + sum(t.priority == priority for t in list(self._resend))
                - sum(t.priority == priority for t in list(self._copies)))

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
               gone: Callable[[], bool] = never_gone) -> Ticket | Refusal:
        """Admit a checked body (sent at once if a worker has room), or refuse it
        (UNAVAILABLE: draining, no ready worker, or the queue is full).

        A ticket whose deadline has already passed is answered 504 at once.
        """
        reason = "server is draining" if self._draining else self._workers.unavailable_reason()
        if reason is not None and self._wait_for_workers and not self._draining:
            reason = None
        lane = None
        if reason is None and not self._queued() and not self._resend:
            lane = self._lane_with_room()
        if reason is None and lane is None and self.depth >= self._capacity:
            reason = "queue is full"
        if reason is not None:
            return self._unavailable(reason)
        now = time.monotonic()
        ticket = Ticket(next(self._ids), body, asyncio.get_running_loop().create_future(),
                        request_id, trace_id, priority,
                        earliest(deadline, now, self._queue_timeout), gone,
                        enqueued_at=now, tokens=self._estimate.cost(len(body)))
        if ticket.deadline is not None and ticket.deadline <= now:
            self._expire(ticket)
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
            log.info("frame_id=%d request_id=%s dropped from the queue: client gone",
                     ticket.frame_id, ticket.request_id)
            self._update_idle()
        if not ticket.outcome.done():
            ticket.outcome.cancel()

    def refuse_waiting(self, reason: str, *, resent_too: bool = True) -> None:
        """Answer every waiting ticket with 503 (no worker is left, or the drain timed out).

        With `resent_too=False` (the last worker was lost and is being replaced) resent tickets
        keep waiting for the replacement: they were admitted while a worker was ready. A
        suspect's queued copy is never refused: its ticket is in flight, and is answered there.
        """
        queues = [*self._waiting.values(), *([self._resend] if resent_too else [])]
        for queue in queues:
            copies = [ticket for ticket in queue if ticket in self._copies]
            while queue:
                ticket = queue.popleft()
                if ticket not in self._copies and not ticket.outcome.done():
                    ticket.outcome.set_result(self._unavailable(reason))
            queue.extend(copies)
        self._update_idle()

    def start_draining(self) -> None:
        """Refuse new requests; what is queued still runs."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once nothing waits and nothing is in flight."""
        await self._idle.wait()

    def lane_suspect(self, lane: Lane, suspect: bool) -> None:
        """A worker became suspect (True) or answered again (False); see the module docstring.

        Suspect: each ticket it holds gets a copy queued at the head of its class (once), sent
        by the ordinary rule to the next worker with room; new traffic flows on meanwhile.
        Healthy again: copies still queued (not sent elsewhere) are taken back.
        """
        mine = [ticket for ticket, lanes in self._sent.items() if lane in lanes]
        if suspect:
            for ticket in reversed(mine):  # each to the head of its class: oldest first
                if not ticket.copied and not ticket.outcome.done():
                    log.warning("frame_id=%d request_id=%s held by a suspect worker: a copy "
                                "goes to another worker (the first answer wins)",
                                ticket.frame_id, ticket.request_id)
                    self._events.resent("suspect")
                    ticket.copied = True
                    ticket.wait_again()
                    self._copies.add(ticket)
                    self._waiting[ticket.priority].appendleft(ticket)
        else:
            for ticket in mine:
                if ticket in self._copies:
                    self._unqueue(ticket)
                    ticket.copied = False
        self.pump()

    def pump(self) -> None:
        """Send waiting tickets while some worker has room: resent ones first, each alone on an
        idle worker; then by class (see BULK_EVERY), oldest first within a class.

        Called after every reply and whenever a worker becomes ready.
        """
        if any(ticket.outcome.done() for ticket in self._resend):  # answered by another copy
            self._resend = deque(t for t in self._resend if not t.outcome.done())
        while self._resend:
            lane = self._idle_lane()
            if lane is None:
                break
            ticket = self._resend.popleft()
            if self._still_wanted(ticket):
                self._send(ticket, lane, alone=True)
        if not self._resend:  # a resent ticket waiting for an idle worker holds the rest back
            while self._queued():
                lane = self._lane_with_room()
                if lane is None:
                    break
                ticket = self._next_waiting()
                self._copies.discard(ticket)
                if self._still_wanted(ticket):
                    self._send(ticket, lane)
        self._update_idle()

    # -- internals ---------------------------------------------------------------------------

    def _wait(self, ticket: Ticket) -> None:
        """Queue a ticket (in its class) and keep its deadline."""
        self._waiting[ticket.priority].append(ticket)
        self._keep_deadline(ticket)

    def _keep_deadline(self, ticket: Ticket) -> None:
        self._deadlines.add(ticket, self.depth)

    def _deadline_passed(self, ticket: Ticket) -> None:
        """A deadline passed: 504 for the ticket if it still waits (not if a copy runs)."""
        if self._unqueue(ticket) and ticket not in self._sent:
            self._expire(ticket)

    def _expire(self, ticket: Ticket) -> None:
        log.info("frame_id=%d request_id=%s class=%s: deadline passed after %.0f ms waiting, "
                 "not sent", ticket.frame_id, ticket.request_id, ticket.priority,
                 ticket.queue_ms)
        self._events.expired(ticket.priority)
        if not ticket.outcome.done():
            ticket.outcome.set_result(Refusal(RefusalKind.EXPIRED, EXPIRED_DETAIL))

    def _unqueue(self, ticket: Ticket) -> bool:
        """Take a waiting ticket (or a queued copy) out of its queue; False if none waited."""
        self._copies.discard(ticket)
        for queue in (self._waiting[ticket.priority], self._resend):
            if ticket in queue:
                queue.remove(ticket)
                return True
        return False

    def _queued(self) -> bool:
        """Whether a ticket or a copy waits in a class queue."""
        return any(self._waiting.values())

    def _next_waiting(self) -> Ticket:
        """The next ticket to send: interactive first, one in BULK_EVERY bulk while both wait."""
        interactive, bulk = self._waiting[INTERACTIVE], self._waiting[BULK]
        if interactive and bulk:
            self._turn += 1
            return (bulk if self._turn % BULK_EVERY == 0 else interactive).popleft()
        return (interactive or bulk).popleft()

    def _still_wanted(self, ticket: Ticket) -> bool:
        """Right before the frame: a ticket whose client left or whose deadline passed is
        answered here instead of being sent."""
        if ticket.outcome.done():
            return False
        if ticket.gone():
            log.info("frame_id=%d request_id=%s not sent: client gone", ticket.frame_id,
                     ticket.request_id)
            ticket.outcome.cancel()
            return False
        if ticket.deadline is not None and ticket.deadline <= time.monotonic():
            self._expire(ticket)
            return False
        return True

    def _lane_with_room(self) -> Lane | None:
        """The next worker with room."""
        return self._ring.pick(has_room, self._alone)

    def _idle_lane(self) -> Lane | None:
        """A ready worker with nothing in flight, for a resent ticket to run alone on."""
        return self._ring.pick(is_idle, self._alone)

    def _send(self, ticket: Ticket, lane: Lane, *, alone: bool = False) -> None:
        ticket.sent(time.monotonic())
        self._sent.setdefault(ticket, []).append(lane)
        if alone:
            self._alone[lane] = ticket
        try:
            lane.submit(Request(ticket.frame_id, ticket.body, ticket.request_id, ticket.trace_id),
                        lambda outcome: self._done(ticket, lane, outcome))
        except WorkerUnavailable as exc:  # has_room said yes; nothing was sent
            self._forget_copy(ticket, lane)
            if not ticket.outcome.done() and ticket not in self._sent:
                ticket.outcome.set_result(self._unavailable(str(exc)))

    def _done(self, ticket: Ticket, lane: Lane, outcome: WorkerOutcome) -> None:
        """A worker answered the ticket (or failed with it in flight): reply, send the next.

        With two copies (one on a suspect worker) the first answer wins: a later one is dropped,
        and a failure is forgotten while the other copy is in flight or queued to be sent.
        """
        self._forget_copy(ticket, lane)
        if ticket.outcome.done():
            if not isinstance(outcome, WorkerFailure) and (ticket.resent or ticket.copied):
                log.info("frame_id=%d request_id=%s answered again by a second worker: the "
                         "later answer is dropped", ticket.frame_id, ticket.request_id)
        elif (isinstance(outcome, WorkerLost) and not ticket.resent and ticket in self._copies
              and ticket not in self._sent):
            self._unqueue(ticket)  # lost with the suspect before its copy went: sent alone
            self._resend_later(ticket, outcome)
        elif isinstance(outcome, WorkerFailure) and (ticket in self._sent
                                                     or ticket in self._resend
                                                     or ticket in self._copies):
            log.info("frame_id=%d request_id=%s: one copy failed (%s), the other is still due",
                     ticket.frame_id, ticket.request_id, outcome)
        elif isinstance(outcome, WorkerLost) and not ticket.resent:
            self._resend_later(ticket, outcome)
        elif isinstance(outcome, WorkerFailure):
            log.error("frame_id=%d request_id=%s failed: %s", ticket.frame_id,
                      ticket.request_id, outcome)
            if not ticket.outcome.done():
                ticket.outcome.set_result(Refusal(RefusalKind.FAILED, INFERENCE_FAILED))
        else:
            ticket.worker_ms = outcome.worker_ms
            ticket.worker_reply = outcome
            if outcome.body is not None:
                self._estimate.learn(len(ticket.body),
                                     outcome.input_tokens + outcome.truncated_tokens)
            if not ticket.outcome.done():
                ticket.outcome.set_result(Answer(outcome))
        self.pump()

    def _forget_copy(self, ticket: Ticket, lane: Lane) -> None:
        """The copy of `ticket` on `lane` is answered, failed, or was never sent."""
        lanes = self._sent.get(ticket)
        if lanes is not None and lane in lanes:
            lanes.remove(lane)
            if not lanes:
                del self._sent[ticket]
        if self._alone.get(lane) is ticket:
            del self._alone[lane]

    def _resend_later(self, ticket: Ticket, failure: WorkerLost) -> None:
        """Queue a ticket lost with its worker to be sent again, alone, before anything else."""
        log.warning("frame_id=%d request_id=%s lost with its worker (%s): sending it again, "
                    "alone", ticket.frame_id, ticket.request_id, failure)
        ticket.started_at = None  # waiting again
        ticket.wait_again()
        self._queue_again(ticket, failure.reason)

    def _queue_again(self, ticket: Ticket, reason: str) -> None:
        """Queue a ticket to be sent again (the once it may be), alone, before anything else."""
        self._events.resent(reason)
        ticket.resent = True
        if ticket.deadline is None:  # bounded even while the last worker is replaced
            ticket.deadline = time.monotonic() + self._resend_timeout
        self._resend.append(ticket)
        self._keep_deadline(ticket)

    def _unavailable(self, reason: str) -> Refusal:
        return Refusal(RefusalKind.UNAVAILABLE, reason, self._retry_after)

    def _update_idle(self) -> None:
        if not self.depth and not self._sent:
            self._idle.set()
        else:
            self._idle.clear()


"""FIFO admission: requests go to the workers in arrival order, the rest wait in that order.

Why a queue and not a "busy" refusal: each worker runs its model on one thread (one CUDA
context, no per-thread cost), so concurrency belongs in front of it, not in it. Each worker (a
`Lane`) may hold up to its `max_batch` requests at once, which it batches into one forward; a
request goes to the next worker with room, and waits in the queue only while none has room. A
request is refused (503 with Retry-After) only when the queue is full, no worker is warm, or the
server is draining. A ticket whose client has gone while it waits is taken out of the queue and
never reaches a worker; once a ticket is in flight its reply is always read (the channel matches
replies by id), so a reply can never be mistaken for someone else's.

Admission knows the workers only through the `Workers` and `Lane` protocols below and tells a
503 from a 500 by the two exceptions of `worker_errors`; it never imports the supervisor, the
pool or the channel, so they can change shape behind it.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clef_frontend import responses
from clef_frontend.responses import Reply, WorkerAnswer
from clef_frontend.worker_errors import WorkerFailure, WorkerUnavailable
from clef_protocol.messages import INFERENCE_FAILED

log = logging.getLogger("clef_frontend.admission")

# Called once per submitted request with its answer, or with the failure that lost it.
Deliver = Callable[[WorkerAnswer | WorkerFailure], None]


class Lane(Protocol):
    """One worker as admission sees it (a Supervisor)."""

    def has_room(self) -> bool: ...

    def submit(
        self, request_id: int, body: bytes, deliver: Deliver, trace_id: str = ""
    ) -> None: ...


class Workers(Protocol):
    """All workers (a WorkerPool)."""

    @property
    def lanes(self) -> Sequence[Lane]: ...

    def unavailable_reason(self) -> str | None: ...


class Refused(Exception):
    """The request cannot join the queue; `reply` is its 503."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


@dataclass(eq=False)
class Ticket:
    """One admitted request, from the queue to its reply."""

    request_id: int
    body: bytes
    outcome: asyncio.Future[Reply]
    trace_id: str = ""
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    worker_ms: float | None = None
    worker_reply: WorkerAnswer | None = None

    @property
    def queue_ms(self) -> float:
        """Time spent waiting for the worker (until now, if still waiting)."""
        end = self.started_at if self.started_at is not None else time.monotonic()
        return (end - self.enqueued_at) * 1000.0


class Admission:
    """The queue, and the hand-over of each ticket to the next worker with room."""

    def __init__(self, *, capacity: int, retry_after: int, workers: Workers) -> None:
        self._capacity = capacity
        self._retry_after = retry_after
        self._workers = workers
        self._waiting: deque[Ticket] = deque()
        self._sent: dict[Ticket, None] = {}  # in flight, oldest first
        self._next_lane = 0
        self._ids = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    @property
    def depth(self) -> int:
        """Tickets waiting (not counting those in flight)."""
        return len(self._waiting)

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
        for ticket in self._sent:
            return ticket.started_at
        return None

    def submit(self, body: bytes, trace_id: str = "") -> Ticket:
        """Admit a checked body (sent at once if a worker has room), or raise Refused (row 14)."""
        reason = "server is draining" if self._draining else self._workers.unavailable_reason()
        lane = None
        if reason is None and not self._waiting:
            lane = self._lane_with_room()
        if reason is None and lane is None and len(self._waiting) >= self._capacity:
            reason = "queue is full"
        if reason is not None:
            raise Refused(responses.unavailable(reason, self._retry_after))
        ticket = Ticket(next(self._ids), body, asyncio.get_running_loop().create_future(),
                        trace_id)
        self._idle.clear()
        if lane is not None:
            self._send(ticket, lane)
        else:
            self._waiting.append(ticket)
        return ticket

    def abandon(self, ticket: Ticket) -> None:
        """The client has gone: drop the ticket if it still waits; if in flight, let it finish."""
        if ticket in self._waiting:
            self._waiting.remove(ticket)
            log.info("request id=%d request_id=%s dropped from the queue: client gone",
                     ticket.request_id, ticket.trace_id)
            self._update_idle()
        if not ticket.outcome.done():
            ticket.outcome.cancel()

    def refuse_waiting(self, reason: str) -> None:
        """Answer every waiting ticket with 503 (no worker is left, or the drain timed out)."""
        while self._waiting:
            ticket = self._waiting.popleft()
            if not ticket.outcome.done():
                ticket.outcome.set_result(responses.unavailable(reason, self._retry_after))
        self._update_idle()

    def start_draining(self) -> None:
        """Refuse new requests; what is queued still runs."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Return once nothing waits and nothing is in flight."""
        await self._idle.wait()

    def pump(self) -> None:
        """Send waiting tickets, oldest first, while some worker has room.

        Called after every reply and whenever a worker becomes ready.
        """
        while self._waiting:
            lane = self._lane_with_room()
            if lane is None:
                break
            self._send(self._waiting.popleft(), lane)
        self._update_idle()

    # -- internals ---------------------------------------------------------------------------

    def _lane_with_room(self) -> Lane | None:
        """The next worker with room, round robin from the one after the last used."""
        lanes = self._workers.lanes
        count = len(lanes)
        for step in range(count):
            index = (self._next_lane + step) % count
            if lanes[index].has_room():
                self._next_lane = (index + 1) % count
                return lanes[index]
        return None

    def _send(self, ticket: Ticket, lane: Lane) -> None:
        ticket.started_at = time.monotonic()
        self._sent[ticket] = None
        try:
            lane.submit(ticket.request_id, ticket.body,
                        lambda outcome: self._done(ticket, outcome), ticket.trace_id)
        except WorkerUnavailable as exc:  # has_room said yes; nothing was sent
            del self._sent[ticket]
            if not ticket.outcome.done():
                ticket.outcome.set_result(responses.unavailable(str(exc), self._retry_after))

    def _done(self, ticket: Ticket, outcome: WorkerAnswer | WorkerFailure) -> None:
        """A worker answered the ticket (or failed with it in flight): reply, send the next."""
        self._sent.pop(ticket, None)
        if isinstance(outcome, WorkerFailure):
            log.error("request id=%d request_id=%s failed: %s", ticket.request_id,
                      ticket.trace_id, outcome)
            reply = responses.error(500, INFERENCE_FAILED)
        else:
            ticket.worker_ms = outcome.worker_ms
            ticket.worker_reply = outcome
            reply = responses.from_worker(outcome)
        if not ticket.outcome.done():
            ticket.outcome.set_result(reply)
        self.pump()

    def _update_idle(self) -> None:
        if not self._waiting and not self._sent:
            self._idle.set()
        else:
            self._idle.clear()

"""FIFO admission: one request in flight to the worker, the rest wait in arrival order.

Why a queue and not a "busy" refusal: the worker runs one request at a time on its main thread
(one CUDA context, no per-thread cost), so concurrency belongs in front of it, not in it. A
request is refused (503 with Retry-After) only when the queue is full, the worker is not warm,
or the server is draining. A ticket whose client has gone while it waits is taken out of the
queue and never reaches the worker; once a ticket is in flight its reply is always read, so the
next reply on the pipe can never be mistaken for someone else's.

Admission knows the worker only through `Forward` (a callable returning a `WorkerAnswer`) and
`unavailable_reason`, and tells a 503 from a 500 by the two exceptions of `worker_errors`; it
never imports the supervisor or the channel, so either can change shape behind it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from clef_frontend import responses
from clef_frontend.responses import Reply, WorkerAnswer
from clef_frontend.worker_errors import WorkerFailure, WorkerUnavailable

log = logging.getLogger("clef_frontend.admission")

# Sends one request (id, body, trace id) to a warm worker; raises WorkerUnavailable
# (nothing sent) or WorkerFailure.
Forward = Callable[[int, bytes, str], Awaitable[WorkerAnswer]]


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
    """The queue and the single dispatcher that feeds the worker from it."""

    def __init__(
        self,
        *,
        capacity: int,
        retry_after: int,
        forward: Forward,
        unavailable_reason: Callable[[], str | None],
    ) -> None:
        self._capacity = capacity
        self._retry_after = retry_after
        self._forward = forward
        self._unavailable_reason = unavailable_reason
        self._waiting: deque[Ticket] = deque()
        self._in_flight: Ticket | None = None
        self._ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False

    @property
    def depth(self) -> int:
        """Tickets waiting (not counting the one in flight)."""
        return len(self._waiting)

    @property
    def draining(self) -> bool:
        """True once `start_draining` was called: the one copy of the server's drain state."""
        return self._draining

    @property
    def in_flight(self) -> int:
        return 0 if self._in_flight is None else 1

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_flight_since(self) -> float | None:
        """`time.monotonic()` at which the request now in flight was sent (None when idle)."""
        return None if self._in_flight is None else self._in_flight.started_at

    def submit(self, body: bytes, trace_id: str = "") -> Ticket:
        """Queue a checked body, or raise Refused with the 503 (row 14)."""
        reason = "server is draining" if self._draining else self._unavailable_reason()
        if reason is None and len(self._waiting) >= self._capacity:
            reason = "queue is full"
        if reason is not None:
            raise Refused(responses.unavailable(reason, self._retry_after))
        ticket = Ticket(next(self._ids), body, asyncio.get_running_loop().create_future(),
                        trace_id)
        self._waiting.append(ticket)
        self._idle.clear()
        self._wakeup.set()
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
        """Answer every waiting ticket with 503 (the worker was lost, or the drain timed out)."""
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

    async def run(self) -> None:
        """The dispatcher: strictly one ticket at a time, in admission order, forever."""
        while True:
            ticket = await self._next()
            self._in_flight = ticket
            ticket.started_at = time.monotonic()
            try:
                reply = await self._dispatch(ticket)
            finally:
                self._in_flight = None
                self._update_idle()
            if not ticket.outcome.done():
                ticket.outcome.set_result(reply)

    async def _dispatch(self, ticket: Ticket) -> Reply:
        try:
            answer = await self._forward(ticket.request_id, ticket.body, ticket.trace_id)
        except WorkerUnavailable as exc:
            return responses.unavailable(str(exc), self._retry_after)
        except WorkerFailure as exc:
            log.error("request id=%d request_id=%s failed: %s", ticket.request_id,
                      ticket.trace_id, exc)
            return responses.error(500, responses.INFERENCE_FAILED)
        ticket.worker_ms = answer.worker_ms
        ticket.worker_reply = answer
        return responses.from_worker(answer)

    async def _next(self) -> Ticket:
        while not self._waiting:
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._waiting.popleft()

    def _update_idle(self) -> None:
        if not self._waiting and self._in_flight is None:
            self._idle.set()
        else:
            self._idle.clear()

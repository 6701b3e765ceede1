"""A ticket: one admitted request, from the queue to its outcome, and the read-only view of it
a driver holds (`TicketView`); the workers as admission sees them (`Lane`, `Workers`: the
supervisors and the pool, behind protocols), and the round robin over them (`LaneRing`).

Each ticket carries three ids, one name each (`clef_protocol.messages`): `frame_id`, the int
id of its request frame; `request_id`, the client's `X-Request-Id`; `trace_id`, the W3C trace
id ("" when untraced). The last two travel in the frame, so the worker's log lines carry them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from clef_dispatch.outcomes import Outcome
from clef_dispatch.urgency import INTERACTIVE
from clef_dispatch.worker_errors import Deliver
from clef_protocol.messages import Request, WorkerReply


class Lane(Protocol):
    """One worker as admission sees it (a Supervisor)."""

    def has_room(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    def submit(self, request: Request, deliver: Deliver) -> None: ...

    @property
    def prefix_slot(self) -> str | None:
        """Its name for the prefix affinity rule while its worker keeps a prefix cache, else
        None (affinity.py)."""
        ...

    @property
    def max_batch(self) -> int:
        """Requests it may hold at once (its worker's `ready` says)."""
        ...

    def serves(self, model: str) -> bool: ...

    def weights_of(self, model: str) -> str | None:
        """The fingerprint its worker serves `model` with (None: it does not serve it)."""
        ...


class Workers(Protocol):
    """All workers (a WorkerPool)."""

    @property
    def lanes(self) -> Sequence[Lane]: ...

    def unavailable_reason(self) -> str | None: ...

    def serving(self, model: str) -> bool: ...

    def knows(self, model: str) -> bool:
        """Whether some worker, ready or restarting, served `model` at its last `ready` (the
        catalogue still lists it)."""
        ...


def never_gone() -> bool:
    return False


def _ignore(_: str) -> None:
    """Default for the event callbacks."""


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted request, from the queue to its reply.

    `gone` says whether the client has left (checked right before the frame is written);
    `deadline` is when a still waiting ticket is answered 504 (`time.monotonic()`; None: never).
    """

    frame_id: int
    body: bytes
    outcome: asyncio.Future[Outcome]
    request_id: str = ""
    trace_id: str = ""
    priority: str = INTERACTIVE
    deadline: float | None = None
    gone: Callable[[], bool] = never_gone
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    worker_ms: float | None = None
    worker_reply: WorkerReply | None = None
    resent: bool = False  # sent again alone after its worker was lost (never a second time)
    copied: bool = False  # a copy was queued while a suspect worker held it (liveness.py)
    tokens: int = 0  # its estimated token cost (load.TokenEstimate), for the utilisation gauge
    affinity: bytes | None = None  # its prefix key (affinity.prefix_key); None: no preference

    # The model it names: a fine-tuned variant's name, or "" for the base. Only a worker that
    # serves it is sent the request (`serving`), so no other model ever scores it.
    model: str = ""
    # The fingerprint the worker it was last sent to serves its model with (None: never sent):
    # an identical request joins it only while those weights are served (answer sharing).
    weights: str | None = None
    queued: bool = False  # has an entry in a queue (waiting.TicketQueue sets it)
    # Queue time is counted per send: the time waiting before each, never the time spent on
    # a worker that was then lost or suspect.
    waiting: bool = True
    waiting_since: float = 0.0
    queued_s: float = 0.0
    last_wait_s: float = 0.0  # the wait that ended at the latest send (`started_at`)

    def __post_init__(self) -> None:
        self.waiting_since = self.enqueued_at

    @property
    def queue_ms(self) -> float:
        """Time spent waiting for a worker, over every send (until now, if waiting)."""
        now = time.monotonic() - self.waiting_since if self.waiting else 0.0
        return (self.queued_s + now) * 1000.0

    def wait_again(self) -> None:
        """Queued again (lost with its worker, or copied from a suspect one)."""
        if not self.waiting:
            self.waiting, self.waiting_since = True, time.monotonic()

    def copy_withdrawn(self) -> None:
        """A suspect's copy left its queue unsent (the suspect answered again, or the ticket was
        answered): the ticket was on a worker all that time, so the copy's wait is no queue
        time and is dropped, not counted."""
        self.waiting = False

    @property
    def last_wait(self) -> tuple[float, float | None]:
        """The latest wait for a worker, per send as `queue_ms` counts it: (began, ended at
        the latest send), or (began, None) when no send has ended it (still waiting, or
        refused or given up unsent since it was queued). A suspect's copy that never went
        leaves the wait before the send that answered."""
        started = self.started_at
        if started is not None:
            return started - self.last_wait_s, started
        return self.waiting_since, None

    def sent(self, now: float) -> None:
        if self.waiting:
            self.last_wait_s = now - self.waiting_since
            self.queued_s += self.last_wait_s
            self.waiting = False
        self.started_at = now


class TicketView:
    """What a driver holds of an admitted request: its outcome and timings, read-only.

    The dispatcher hands this out, never the `Ticket` itself, so no driver can move a ticket
    between queues, change its deadline or settle it: only admission does. The driver awaits
    `outcome` (admission alone sets it) and gives the request up through
    `Dispatcher.abandon`. One small object a request, reading through to the ticket, so the
    timings are always the current ones.
    """

    __slots__ = ("_ticket",)

    def __init__(self, ticket: Ticket) -> None:
        self._ticket = ticket

    @property
    def outcome(self) -> asyncio.Future[Outcome]:
        """Resolves to the request's Answer or Refusal (cancelled once it is given up)."""
        return self._ticket.outcome

    @property
    def at_worker(self) -> bool:
        """Whether a worker holds the request now (sent, not yet answered, not back in the
        queue after its worker was lost): what answer sharing asks of a flight."""
        ticket = self._ticket
        return ticket.started_at is not None and not ticket.outcome.done()

    @property
    def weights(self) -> str | None:
        """The fingerprint of the weights the worker it was last sent to serves its model with
        (None: never sent): what answer sharing asks before a request joins it."""
        return self._ticket.weights

    @property
    def request_id(self) -> str:
        return self._ticket.request_id

    @property
    def waiting(self) -> bool:
        """Whether no send of it is under way: queued, never sent, or back in the queue after
        its worker was lost (clef-batch withdraws these when it stops)."""
        return self._ticket.started_at is None

    @property
    def queue_ms(self) -> float:
        return self._ticket.queue_ms

    @property
    def worker_ms(self) -> float | None:
        return self._ticket.worker_ms

    @property
    def worker_reply(self) -> WorkerReply | None:
        return self._ticket.worker_reply

    @property
    def last_wait(self) -> tuple[float, float | None]:
        return self._ticket.last_wait


def ticket_of(view: TicketView) -> Ticket:
    """The ticket behind a view: for the dispatcher's own door (`Dispatcher.abandon`) only."""
    return view._ticket


@dataclass(frozen=True)
class AdmissionEvents:
    """What admission reports to the metrics: a resend (its reason) and a deadline that
    passed while waiting (the ticket's class)."""

    resent: Callable[[str], None] = _ignore
    expired: Callable[[str], None] = _ignore


class LaneRing:
    """Which worker gets the next ticket, among those that fit and are not running a resent
    ticket alone: the first in round-robin order from the one after the last used (`pick`), or
    the least loaded, ties in that order (`least_loaded`)."""

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self._next = 0

    def pick(self, fits: Callable[[Lane], bool], busy_alone: Container[Lane]) -> Lane | None:
        for index, lane in self._in_turn(fits, busy_alone):
            self._next = (index + 1) % len(self._workers.lanes)
            return lane
        return None

    def least_loaded(self, fits: Callable[[Lane], bool],
                     busy_alone: Container[Lane]) -> Lane | None:
        """The fitting worker holding the fewest requests; among equals the next in turn, so
        requests answered one at a time still go round every worker."""
        best: tuple[int, Lane] | None = None
        for index, lane in self._in_turn(fits, busy_alone):
            if best is None or lane.in_flight < best[1].in_flight:
                best = (index, lane)
        if best is None:
            return None
        self._next = (best[0] + 1) % len(self._workers.lanes)
        return best[1]

    def _in_turn(self, fits: Callable[[Lane], bool],
                 busy_alone: Container[Lane]) -> Iterator[tuple[int, Lane]]:
        """The fitting workers and their indexes, from the one after the last used."""
        lanes = self._workers.lanes
        count = len(lanes)
        for step in range(count):
            index = (self._next + step) % count
            lane = lanes[index]
            if lane not in busy_alone and fits(lane):
                yield index, lane


def has_room(lane: Lane) -> bool:
    return lane.has_room()


def is_idle(lane: Lane) -> bool:
    return lane.has_room() and lane.in_flight == 0

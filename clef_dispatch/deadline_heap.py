"""The deadlines of waiting tickets: one timer, aimed at the earliest, for the whole queue; and
the one rule that judges a passed deadline (`past_deadline`), wherever admission finds it.

Apart from admission's queue because it is a structure of its own: a heap of (deadline, frame
id, ticket) with stale entries left in place (a heap has no cheap removal) and dropped in bulk,
and the one event-loop timer that calls `due` with the tickets whose deadline has passed.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import time
from collections.abc import Callable

from clef_dispatch.ticket import Ticket

# Deadline entries of tickets that left the queue, kept beyond twice the queue's depth before
# the heap is rebuilt without them (see DeadlineHeap.add).
STALE_DEADLINES_KEPT = 64


class Past(enum.Enum):
    """What a ticket's deadline means for it now (`past_deadline`)."""

    NOT_YET = "not yet"  # no deadline, or not passed: nothing happens
    HELD = "held"  # passed while a worker holds it: never expired; a queued copy is withdrawn
    EXPIRED = "expired"  # passed and no worker holds it: 504, taken out of its queue


def past_deadline(ticket: Ticket, *, held: bool, now: float) -> Past:
    """The one deadline rule, which admission applies wherever it finds a deadline passed: by
    the timer, right before a frame is written, and on the resend path (a suspect's copy, a lost
    ticket). `held`: a worker holds the ticket now.

    A ticket a worker holds is never expired: its answer is computed, and is delivered however
    late (docs/api.md: a request on a worker is answered). So past its deadline a suspect's
    queued copy is withdrawn unsent and the original's answer awaited, and a ticket held by a
    worker that turns suspect gets no copy (with `--queue-timeout`, counted from admission, a
    long forward is past it as soon as it turns suspect). A ticket no worker holds (waiting, or
    lost with its worker) is answered 504."""
    if ticket.deadline is None or ticket.deadline > now:
        return Past.NOT_YET
    return Past.HELD if held else Past.EXPIRED


class DeadlineHeap:
    """Keeps the deadlines; `due(ticket)` is called for each one that passes (the ticket may
    have left the queue meanwhile: `due` decides), then `after_due()` once."""

    def __init__(self, due: Callable[[Ticket], None], after_due: Callable[[], None]) -> None:
        self._due = due
        self._after_due = after_due
        self._heap: list[tuple[float, int, Ticket]] = []
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def tickets(self) -> list[Ticket]:
        """The tickets whose deadlines are kept (stale ones included)."""
        return [entry[2] for entry in self._heap]

    def add(self, ticket: Ticket, live: int) -> None:
        """Keep `ticket`'s deadline (none: nothing to keep); `live` is how many tickets wait
        now, so stale entries are dropped once they outnumber them."""
        if ticket.deadline is None:
            return
        heapq.heappush(self._heap, (ticket.deadline, ticket.frame_id, ticket))
        if self._heap[0][2] is ticket:  # the new earliest: aim the timer at it
            self._arm()
        elif len(self._heap) > 2 * live + STALE_DEADLINES_KEPT:
            self._drop_stale()

    def _drop_stale(self) -> None:
        """Forget the deadlines of tickets no longer queued (sent, answered, given up; a
        suspect's queued copy is kept: the deadline rule withdraws it).

        Without this, `--queue-timeout` seconds of every ticket, bodies included, would stay
        referenced here. Rebuilt once stale entries outnumber live ones, so each entry is
        copied at most once on average."""
        self._heap = [entry for entry in self._heap
                      if entry[2].queued and not entry[2].outcome.done()]
        heapq.heapify(self._heap)
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._heap:
            self._timer = asyncio.get_running_loop().call_at(
                _loop_time(self._heap[0][0]), self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, ticket = heapq.heappop(self._heap)
            self._due(ticket)
        self._arm()
        self._after_due()


def _loop_time(monotonic: float) -> float:
    """A `time.monotonic()` instant on the event loop's clock (they may differ in origin)."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic - time.monotonic())

"""Where admission's tickets wait (`TicketQueue`), and the counts a scrape reads (`Counts`).

Why plain ints: prometheus_client calls the gauges' callbacks on the metrics port's thread while
the event loop moves tickets between the class queues, the lost tickets and the workers. A
depth summed from several containers, each measured at a different moment, tore: a thread
reading while the loop copied a suspect's tickets and took them back read -1 and -2 (a queue's
length taken before the copies went in, the copies subtracted after), or one ticket twice. Here
the loop recounts each ticket it moved once the move is complete (`Counts.settle`), and every
gauge reads one int. Each int is written only by the loop, one step per settled ticket, so
whichever moment a read lands on, it is the count of a state the loop really was in.

Each ticket counts once. It is *waiting* while it has an entry in a queue (its class queue, or
the lost tickets waiting to go alone) and no worker holds it; *in flight* while a worker holds
it (a suspect's ticket whose copy waits in its class queue is in flight, not also waiting; once
no worker holds it, the copy is what waits for it, and it counts as waiting).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from clef_dispatch.ticket import Ticket
from clef_dispatch.urgency import CLASSES


class TicketQueue:
    """A FIFO of tickets that marks each ticket's entry (`Ticket.queued`), so whether a ticket
    has somewhere to wait is known without searching every queue. A ticket is in one queue at
    most (admission takes a suspect's copy out before the ticket joins the lost ones)."""

    def __init__(self) -> None:
        self._tickets: deque[Ticket] = deque()

    def __len__(self) -> int:
        return len(self._tickets)

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(self._tickets)

    def __contains__(self, ticket: object) -> bool:
        return isinstance(ticket, Ticket) and ticket.queued and ticket in self._tickets

    def append(self, ticket: Ticket) -> None:
        ticket.queued = True
        self._tickets.append(ticket)

    def appendleft(self, ticket: Ticket) -> None:
        ticket.queued = True
        self._tickets.appendleft(ticket)

    def popleft(self) -> Ticket:
        ticket = self._tickets.popleft()
        ticket.queued = False
        return ticket

    def remove(self, ticket: Ticket) -> bool:
        """Take `ticket` out; False if it was not here."""
        if ticket not in self:
            return False
        self._tickets.remove(ticket)
        ticket.queued = False
        return True

    def take(self, leaves: Callable[[Ticket], bool]) -> list[Ticket]:
        """Take out every ticket for which `leaves` is true (in order); the rest stay, in order."""
        stay: deque[Ticket] = deque()
        gone: list[Ticket] = []
        for ticket in self._tickets:
            (gone if leaves(ticket) else stay).append(ticket)
        if gone:
            self._tickets = stay
            for ticket in gone:
                ticket.queued = False
        return gone


class Counts:
    """The waiting tickets (in all and per class), and the estimated tokens waiting, in flight
    and outstanding (either, each ticket once), as plain ints the gauges read from any thread.

    Only the loop writes them, through `settle`: call it for each ticket a change touched, once
    the change is complete (a ticket moved from its queue to a worker, or from a worker to the
    lost tickets, is recounted in one step, never seen nowhere or in two places).
    """

    def __init__(self) -> None:
        self.waiting = 0
        self.waiting_in: dict[str, int] = dict.fromkeys(CLASSES, 0)
        self.tokens_waiting = 0
        self.tokens_in_flight = 0
        self.tokens_outstanding = 0
        # How each counted ticket is counted now: (waiting, in flight). Loop-side only.
        self._counted: dict[Ticket, tuple[bool, bool]] = {}

    def settle(self, ticket: Ticket, *, in_flight: bool) -> None:
        """Count `ticket` where it is now: `in_flight` says whether a worker holds it."""
        waiting = ticket.queued and not in_flight
        was_waiting, was_in_flight = self._counted.get(ticket, (False, False))
        if (waiting, in_flight) == (was_waiting, was_in_flight):
            return
        if waiting or in_flight:
            self._counted[ticket] = (waiting, in_flight)
        else:
            del self._counted[ticket]
        if (waiting or in_flight) != (was_waiting or was_in_flight):
            self.tokens_outstanding += ticket.tokens if waiting or in_flight else -ticket.tokens
        if in_flight != was_in_flight:
            self.tokens_in_flight += ticket.tokens if in_flight else -ticket.tokens
        if waiting != was_waiting:
            step = 1 if waiting else -1
            self.tokens_waiting += step * ticket.tokens
            self.waiting_in[ticket.priority] += step
            self.waiting += step


class CountReads:
    """The reads the gauges make of admission's `Counts` (admission inherits them).

    They may run on the metrics port's thread while the loop changes the queues: each reads
    one int of `Counts` (never a container, nor two counts to combine), so a scrape sees the
    count of a state the loop really was in. Each ticket counts once: a suspect's ticket whose
    copy waits is in flight, not waiting.
    """

    _counts: Counts

    @property
    def tokens_waiting(self) -> int:
        """Estimated tokens of the tickets waiting (resent ones included)."""
        return self._counts.tokens_waiting

    @property
    def tokens_in_flight(self) -> int:
        """Estimated tokens of the tickets sent to a worker and not yet answered."""
        return self._counts.tokens_in_flight

    @property
    def tokens_outstanding(self) -> int:
        """Estimated tokens of the tickets waiting or in flight, each once, in one read (the
        sum of the two above, read one after the other, could count a ticket sent between the
        reads twice or not at all)."""
        return self._counts.tokens_outstanding

    @property
    def depth(self) -> int:
        """Tickets waiting (not counting those in flight)."""
        return self._counts.waiting

    def depth_of(self, priority: str) -> int:
        """Tickets of one class waiting (a resent ticket counts in its class)."""
        return self._counts.waiting_in[priority]

"""Admission's waiting counts, the numbers behind `clef_requests_queued` and the per-class depth:
read from a scrape thread while the loop moves tickets, they never tear, and after every kind
of move they equal what the queues really hold, each ticket counted once.

Why a thread: prometheus_client calls the gauges' callbacks on the metrics port's thread while
the event loop changes admission's state, so a read may land between any two of the loop's
bytecodes (a small `sys.setswitchinterval` makes the interpreter switch there often)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from clef_dispatch.load import TokenEstimate
from clef_dispatch.ticket import Ticket
from clef_dispatch.urgency import BULK, CLASSES, INTERACTIVE
from clef_dispatch.worker_errors import WorkerExited, WorkerFailure
from tests.doubles import Admission, FakeLane, FakeWorkers, reply_of

# Tickets a round of the hammer holds on the lane that turns suspect, and the rounds: enough
# mutations for a torn read to show (before the counts were plain ints, 2 runs in 3 read a
# negative depth with far fewer), few enough to finish in about a second.
HELD = 4
ROUNDS = 400


@contextmanager
def switching_often() -> Iterator[None]:
    """Let the interpreter switch threads every microsecond (restored afterwards)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class Scraper(threading.Thread):
    """Reads the gauges in a loop until told to stop, keeping every reading outside its bound.

    `gauges` maps a name to its read and the most it can be at any moment of the scenario; no
    reading may ever be negative."""

    def __init__(self, gauges: dict[str, tuple[Callable[[], int], int]]) -> None:
        super().__init__(daemon=True)
        self._gauges = gauges
        self.reading = threading.Event()  # set after the first full read
        self.stop = threading.Event()
        self.reads = 0
        self.wrong: list[tuple[str, int]] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for name, (read, bound) in self._gauges.items():
                value = read()
                if not 0 <= value <= bound and len(self.wrong) < 20:
                    self.wrong.append((name, value))
            self.reads += 1
            self.reading.set()


def test_a_scrape_thread_never_reads_a_torn_depth() -> None:
    """The loop copies a suspect's tickets, takes the copies back, copies them again, loses
    them with the worker (each becomes a lost ticket waiting to go alone) and refuses them,
    round after round, while a thread reads the gauges: every reading lies between 0 and what
    the scenario can hold (HELD tickets; per class, those of the class; their tokens)."""
    classes = [INTERACTIVE if i % 2 else BULK for i in range(HELD)]
    suspect, other = FakeLane(room=HELD), FakeLane(room=0)  # copies wait: `other` is full
    estimate = TokenEstimate(max_length=1000)
    admission = Admission(capacity=4 * HELD, retry_after=1, workers=FakeWorkers(suspect, other),
                          estimate=estimate)
    gauges: dict[str, tuple[Callable[[], int], int]] = {
        "depth": (lambda: admission.depth, HELD),
        "tokens_outstanding": (lambda: admission.tokens_outstanding,
                               HELD * estimate.cost(1)),
    }
    for name in CLASSES:
        gauges[name] = (partial(admission.depth_of, name), classes.count(name))
    scraper = Scraper(gauges)

    async def scenario() -> None:
        scraper.start()
        assert await asyncio.to_thread(scraper.reading.wait, 10)
        for _ in range(ROUNDS):
            suspect.ready, suspect.room = True, HELD
            tickets = [admission.submit(b"x", priority=name) for name in classes]
            suspect.room = 0
            admission.lane_suspect(suspect, True)  # HELD copies queued, the tickets in flight
            admission.lane_suspect(suspect, False)  # taken back
            admission.lane_suspect(suspect, True)
            suspect.ready = False
            held, suspect.held = suspect.held, []
            for _, deliver in held:
                deliver(WorkerExited("worker closed its output"))  # lost: each waits alone
            assert admission.depth == HELD
            admission.refuse_waiting("worker is restarting")
            assert all(ticket.outcome.done() for ticket in tickets)
            assert admission.depth == 0 and admission.in_flight == 0

    with switching_often():
        try:
            asyncio.run(scenario())
        finally:
            scraper.stop.set()
            scraper.join(10)
    assert not scraper.is_alive()
    assert scraper.reads > 0
    assert scraper.wrong == []


# -- the counts against the queues, after each kind of move ---------------------------------------


def true_counts(admission: Admission) -> dict[str, int]:
    """The counts the slow way, from admission's containers themselves (read for this test
    only): a ticket waits while it has a queue entry and no worker holds it."""
    sent = set(admission._sent)
    entries = [t for queue in admission._waiting.values() for t in queue]
    entries += list(admission._resends._lost)
    assert len({id(t) for t in entries}) == len(entries)  # one entry per ticket at most
    waiting = [t for t in entries if t not in sent]
    counts = {name: sum(t.priority == name for t in waiting) for name in CLASSES}
    counts.update(depth=len(waiting), tokens_waiting=sum(t.tokens for t in waiting),
                  tokens_in_flight=sum(t.tokens for t in sent),
                  tokens_outstanding=sum(t.tokens for t in {*waiting, *sent}))
    return counts


def counts(admission: Admission) -> dict[str, int]:
    """What the gauges read."""
    read = {name: admission.depth_of(name) for name in CLASSES}
    read.update(depth=admission.depth, tokens_waiting=admission.tokens_waiting,
                tokens_in_flight=admission.tokens_in_flight,
                tokens_outstanding=admission.tokens_outstanding)
    return read


def check(admission: Admission, depth: int, in_flight: int) -> None:
    """The gauges equal the queues' real contents, and the depth and in-flight count are what
    the test expects at this step."""
    assert counts(admission) == true_counts(admission)
    assert (admission.depth, admission.in_flight) == (depth, in_flight)


def deliver_oldest(lane: FakeLane, outcome: WorkerFailure) -> None:
    lane.held.pop(0)[1](outcome)


def test_counts_follow_enqueue_send_abandon_expiry_answer_and_refusal() -> None:
    async def scenario() -> None:
        lane = FakeLane(room=1)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(lane))
        first = admission.submit(b"first")  # sent at once
        check(admission, 0, 1)
        second = admission.submit(b"second", priority=BULK)  # enqueued
        left = admission.submit(b"left")
        check(admission, 2, 1)
        assert (admission.depth_of(INTERACTIVE), admission.depth_of(BULK)) == (1, 1)
        admission.abandon(left)
        check(admission, 1, 1)
        expires = admission.submit(b"expires", deadline=time.monotonic() + 0.05)
        check(admission, 2, 1)
        assert (await reply_of(expires)).status == 504  # the deadline timer took it out
        check(admission, 1, 1)
        lane.answer_oldest()  # `second` is sent in the same step
        assert (await reply_of(first)).status == 200
        check(admission, 0, 1)
        refused = admission.submit(b"refused")
        check(admission, 1, 1)
        admission.refuse_waiting("server is draining")
        assert (await reply_of(refused)).status == 503
        check(admission, 0, 1)
        lane.answer_oldest()
        assert (await reply_of(second)).status == 200
        check(admission, 0, 0)
        assert counts(admission) == dict.fromkeys(counts(admission), 0)

    asyncio.run(scenario())


def test_counts_follow_a_suspects_copies_made_taken_back_sent_and_answered() -> None:
    async def scenario() -> None:
        suspect, other = FakeLane(room=2), FakeLane(room=0)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(suspect, other))
        held = [admission.submit(b"a"), admission.submit(b"b", priority=BULK)]
        check(admission, 0, 2)
        suspect.room = 0
        admission.lane_suspect(suspect, True)  # two copies queued: counted in flight only
        check(admission, 0, 2)
        assert all(ticket.queued for ticket in held)
        admission.lane_suspect(suspect, False)  # taken back
        check(admission, 0, 2)
        assert not any(ticket.queued for ticket in held)
        admission.lane_suspect(suspect, True)
        waits = admission.submit(b"new")
        check(admission, 1, 2)
        other.room = 1
        admission.pump()  # the oldest copy goes to `other`: still one ticket in flight
        assert other.sent == [b"a"]
        check(admission, 1, 2)
        other.answer_oldest()  # the copy answers first
        assert (await reply_of(held[0])).body == b"a"
        # `new` took `other`'s room (interactive first); the suspect still holds `a` and `b`,
        # and `b`'s copy waits: three in flight, none waiting
        check(admission, 0, 3)
        assert other.sent == [b"a", b"new"]
        suspect.answer_oldest()  # the suspect's late `a`: dropped
        suspect.answer_oldest()  # `b` answered on the suspect: its queued copy leaves
        assert (await reply_of(held[1])).body == b"b"
        check(admission, 0, 1)
        assert not held[1].queued
        other.answer_oldest()
        assert (await reply_of(waits)).body == b"new"
        check(admission, 0, 0)

    asyncio.run(scenario())


def test_a_copy_left_alone_counts_once_as_waiting_and_is_refused_with_the_resent() -> None:
    """A suspect's ticket fails on the suspect while its copy waits: no worker holds it, so
    it counts once, as waiting; refused without the resent tickets it stays, with them it
    goes."""
    async def scenario() -> None:
        suspect, other = FakeLane(room=1), FakeLane(room=0)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(suspect, other))
        ticket = admission.submit(b"a")
        suspect.room = 0
        admission.lane_suspect(suspect, True)
        check(admission, 0, 1)
        admission.refuse_waiting("worker is restarting")  # its ticket in flight: stays
        check(admission, 0, 1)
        assert not ticket.outcome.done()
        deliver_oldest(suspect, WorkerFailure("worker stopped"))  # the other copy is due
        check(admission, 1, 0)
        admission.refuse_waiting("worker is restarting", resent_too=False)
        check(admission, 1, 0)
        admission.refuse_waiting("server is draining")
        check(admission, 0, 0)
        assert (await reply_of(ticket)).status == 503

    asyncio.run(scenario())


def test_counts_follow_a_lost_ticket_its_resend_and_a_lost_suspect() -> None:
    async def scenario() -> None:
        lane, spare = FakeLane(room=2), FakeLane(room=1)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(lane, spare))
        lost, busy, held = (admission.submit(b"lost"), admission.submit(b"busy"),
                            admission.submit(b"held"))
        assert lane.sent == [b"lost", b"held"] and spare.sent == [b"busy"]
        check(admission, 0, 3)
        lane.ready = False
        deliver_oldest(lane, WorkerExited("worker closed its output"))  # waits to go alone
        check(admission, 1, 2)
        assert lost.resent and lost.queued
        later = admission.submit(b"later")  # waits behind the lost ticket
        check(admission, 2, 2)
        spare.answer_oldest()  # `spare` idle: the lost ticket goes there, alone
        assert (await reply_of(busy)).status == 200
        assert spare.sent == [b"busy", b"lost"]
        check(admission, 1, 2)
        # `held`, on a worker that turns suspect and is then lost before its copy went: the
        # copy becomes its one resend, waiting alone (the only worker left is busy).
        admission.lane_suspect(lane, True)
        check(admission, 1, 2)
        deliver_oldest(lane, WorkerExited("worker closed its output"))
        check(admission, 2, 1)
        assert held.resent and not admission._resends.is_copy(held)
        admission.refuse_waiting("worker is restarting", resent_too=False)  # `later` goes
        assert (await reply_of(later)).status == 503
        check(admission, 1, 1)
        spare.answer_oldest()  # `lost` answered; `held` goes alone
        assert (await reply_of(lost)).status == 200
        check(admission, 0, 1)
        spare.answer_oldest()
        assert (await reply_of(held)).status == 200
        check(admission, 0, 0)

    asyncio.run(scenario())


def test_a_lost_ticket_whose_client_left_is_dropped_from_the_count() -> None:
    async def scenario() -> None:
        lane, busy = FakeLane(room=1), FakeLane(room=1)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(lane, busy))
        ticket, other = admission.submit(b"x"), admission.submit(b"y")
        lane.ready = False
        deliver_oldest(lane, WorkerExited("worker closed its output"))
        check(admission, 1, 1)
        ticket.outcome.cancel()  # the client left without an abandon: dropped at the next pump
        admission.pump()
        check(admission, 0, 1)
        busy.answer_oldest()
        assert (await reply_of(other)).status == 200
        check(admission, 0, 0)
        assert isinstance(ticket, Ticket) and not ticket.queued

    asyncio.run(scenario())

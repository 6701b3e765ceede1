"""Duplicates answered once, in one object: identical requests in flight share one forward, and
a bounded LRU of answers answers repeats.

Identical means the same key identity (its name, `-` without auth) and the same parsed body in
its own order (`identity`); the body names the model, so two models' answers never mix. Order is
part of a request: the questions' order is the prompt's order and the answer's order, and so are
the criteria's and the levels'; so the body is serialised as parsed, keys never sorted, and only
what parsing forgets (spacing, escapes) is ignored. An answer is a pure function of the request
and the weights, which is what makes sharing it correct; so each kept answer records the model that
scored it (a fine-tuned variant's name, "" for the base) and the fingerprint of that model's
weights (the worker's `response` frame says it, from the fingerprints it reports in `ready`),
and is served only while a ready worker serves that model with those weights (`serving`, asked
at every hit). Whatever order workers restart in after weights are replaced in place, an answer
of weights no ready worker serves is never returned from memory (it is dropped when found, and
never kept when it lands), and the answers of weights still served survive a rolling restart.
Answers are never shared across keys, because a fast answer would tell one tenant what another
asked.

One rule for who may be served what, the same for a kept answer, a joiner and a landing: an
answer from weights no ready worker serves goes to nobody but the request that was already on
the worker computing it. So a request does not join a forward running on a worker that a roll
has retired (the weights it computes with, `TicketView.weights`, are no longer served), and a
forward that lands with such weights hands its joiners `NOT_SHARED` (each then runs on its
own). Joining never changes a request's fate either: a joiner's own deadline applies only
while the forward it waits for waits for a worker (as its own ticket's would: a request on a
worker is never expired), and a request carrying its own deadline that a worker would take at
once (`takes_now`) runs on its own rather than wait on a forward already under way.

`AnswerCache` owns the whole of sharing: the decision (`share`: a kept answer is a `hit`, an
identical request in flight is joined, `coalesced`, else this request is the first of its kind,
a `miss`), the flight's life once admitted (`admitted`), and, in one call the pipeline makes
(`answer`), the wait for the answer whichever way it comes: a joiner's own deadline and own
client, the first request's client leaving, the landing of the first request's outcome to its
joiners and the LRU, and the joiner's admission on its own when the shared request was not
answered. Rules:

- Only a scored answer (a 200) of weights still served is kept, and only such a 200 is handed
  to joiners, waiting or late. Anything else the shared request came to (a refusal of the
  queue or of its deadline, a worker's own 500 or 422, a 200 of retired weights) is not the
  joiner's: each joiner is told `NOT_SHARED` and is admitted on its own, so a worker's
  transient 500 costs a joiner nothing. One exception: the 500 of a request that failed twice
  (its worker was lost with it, then the worker it ran alone on) is handed over as it is,
  since admitting each joiner again would let a poison request kill two more workers a
  joiner.
- A joiner that is admitted on its own counts as a `miss`, not `coalesced`: the lookup counter
  says how each request's answer came (the pipeline counts it once the answer has come).
- The kept answers are bounded twice: by count (`--answer-cache`) and by bytes
  (`--answer-cache-bytes`), each entry counted at what it costs in memory (`entry_bytes`,
  measured: about 880 bytes beyond the body), so one large answer cannot hold the memory of
  thousands and many cannot outgrow the bytes; the least recently used go first.

The first request waits on its ticket's outcome; each joiner waits on its own future, so one
client leaving (or one joiner's deadline passing) does not cancel the others'; the shared request
leaves the queue only once every caller of it has left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import marshal
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from clef_dispatch import (
    INTERACTIVE,
    SHARED_EXPIRED_DETAIL,
    Answer,
    Outcome,
    Refusal,
    RefusalKind,
    TicketView,
    earliest,
)

log = logging.getLogger("clef_frontend.answer_cache")

HIT, COALESCED, MISS = "hit", "coalesced", "miss"

# What a joiner is told when the request it shared was refused: admit yourself (never shown).
NOT_SHARED = Refusal(RefusalKind.UNAVAILABLE, "the shared request was refused")
# The default bound of the kept answers' bytes (`--answer-cache-bytes`).
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# What an entry costs that `sys.getsizeof` over its objects cannot see: its slot in the
# OrderedDict (the hash table's entry and the order list's node, 85 bytes measured with
# tracemalloc on CPython 3.11) and the field values of the reply, a dataclass without
# `__slots__`, which live in an array of their own (its header, then 8 bytes a field).
# tests/test_answer_cache_bytes.py checks the whole count against tracemalloc.
_TABLE_SLOT_BYTES = 88
_VALUES_HEAD_BYTES = 24
_FIELD_BYTES = 8

# marshal's version 2 has no back-references (version 3 added them), so equal documents give
# equal bytes whatever objects they share; it keeps dict order and tells bool, int and float
# apart, as the JSON the worker reads does.
_MARSHAL_VERSION = 2


def identity(key_name: str, request: dict[str, Any]) -> bytes:
    """What two requests must share to share an answer: the key's name and the parsed body in
    its own order, serialised (marshal: cheaper than re-encoding the JSON, and as exact) and
    hashed (SHA-256, so the table holds 32 bytes a request whatever its size). The identity never
    leaves the process, so marshal's format only has to be stable within one."""
    digest = hashlib.sha256(key_name.encode("utf-8"))
    digest.update(b"\0")
    digest.update(marshal.dumps(request, _MARSHAL_VERSION))
    return digest.digest()


def entry_bytes(key: bytes, kept: Kept) -> int:
    """What keeping `kept` under `key` costs in memory: `sys.getsizeof` over every object the
    entry holds (the key, the entry, the answer, the reply, its body, its numbers, its stage
    timings and its weights fingerprint), plus what getsizeof cannot see (the table's slot, the
    reply's field values). About 880 bytes beyond the body for a worker's reply with its three
    stage timings and its fingerprint (770 without the fingerprint). Objects shared by every
    entry (None, small ints, the empty string, the stage names, which the frame decoder
    interns) cost an entry nothing and are not counted."""
    return _TABLE_SLOT_BYTES + sys.getsizeof(key) + _footprint(kept)


def _footprint(obj: object) -> int:
    """getsizeof over `obj` and what it holds (dataclass fields, a dict's values, a sequence's
    items); a dict's keys are names shared across entries and cost nothing here."""
    if (obj is None or isinstance(obj, bool) or (isinstance(obj, int) and -5 <= obj <= 256)
            or obj == ""):
        return 0  # shared by the interpreter (the empty string too: a base answer's model)
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        return size + sum(_footprint(value) for value in obj.values())
    if isinstance(obj, list | tuple):
        return size + sum(_footprint(item) for item in obj)
    if dataclasses.is_dataclass(obj):
        fields = dataclasses.fields(obj)
        if not hasattr(type(obj), "__slots__"):
            size += _VALUES_HEAD_BYTES + _FIELD_BYTES * len(fields)
        return size + sum(_footprint(getattr(obj, field.name)) for field in fields)
    return size


# What the pipeline's `RequestIO.wait_answer` is: await a future while the client is watched,
# calling the second argument if the client leaves (then ClientGone is raised).
Wait = Callable[[asyncio.Future[Outcome], Callable[[], None]], Awaitable[Outcome]]


@dataclass(eq=False, slots=True)
class Flight:
    """A forward that identical requests share.

    Its first request waits on its own ticket's outcome, as a request does with the cache off
    (so a miss costs no future and no callback of its own); each request that joins it later
    waits on a future of its own, so that one caller leaving, or one caller's deadline passing,
    cancels nobody else's wait. The flight keeps its own record of what joining depends on:
    `key` is the requests' identity; `first_gone` says whether the first request's client
    has left; `priority` and `deadline` are the first request's class and the deadline that
    applies to it (its own or the queue timeout, `clef_dispatch.earliest`); once it is admitted,
    `ticket` is the dispatcher's read-only view of it (whether a worker holds it) and `outcome`
    the future its answer arrives on; `on_all_gone` gives the request up once nobody waits.
    `model` is the model the request names ("": the base), which its kept answer records.
    """

    key: bytes
    first_gone: Callable[[], bool]
    model: str = ""
    priority: str = INTERACTIVE
    deadline: float | None = None
    outcome: asyncio.Future[Outcome] | None = None
    ticket: TicketView | None = None
    on_all_gone: Callable[[], None] | None = None
    joiners: list[asyncio.Future[Outcome]] | None = None
    first_left: bool = False

    def join(self) -> asyncio.Future[Outcome]:
        mine: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        if self.joiners is None:
            self.joiners = []
        self.joiners.append(mine)
        return mine

    def all_gone(self) -> bool:
        """The first request's client has left and every joiner has its answer or has left
        (the dispatcher then never sends the request)."""
        if not (self.first_left or self.first_gone()):
            return False
        return self.joiners is None or all(joiner.done() for joiner in self.joiners)

    def leave(self, mine: asyncio.Future[Outcome]) -> None:
        """A joiner is done waiting (its client left, its deadline passed): its wait ends; the
        last one out gives up the request."""
        if not mine.done():
            mine.cancel()
        self._give_up_if_all_gone()

    def first_leaves(self) -> bool:
        """The first request's client left. With nobody else waiting the request is given up
        (its outcome is cancelled, which ends the first request's wait); while joiners wait it
        goes on for them, and the first request's wait ends when the answer comes. True if it
        goes on."""
        self.first_left = True
        return not self._give_up_if_all_gone()

    def _give_up_if_all_gone(self) -> bool:
        if not self.all_gone():
            return False
        if self.on_all_gone is not None:
            self.on_all_gone()
        return True


@dataclass(frozen=True, slots=True)
class Kept:
    """One kept answer: the entry type of the LRU (what it holds, `entry_bytes` counts), and
    the model that scored it ("": the base; its weights are `answer.reply.weights`)."""

    answer: Answer
    model: str = ""

    @property
    def weights(self) -> str:
        return self.answer.reply.weights


def _always(model: str, weights: str) -> bool:
    """The default `serving`: every answer's weights are served (tests without workers)."""
    return True


def _never(model: str) -> bool:
    """The default `takes_now`: no worker would take a request at once (tests without
    workers), so a joiner with a deadline joins as any other."""
    return False


@dataclass(frozen=True, slots=True)
class Shared:
    """How one request gets its answer: `how` (HIT, COALESCED or MISS), the future it awaits
    (a hit's, already set; a joiner's own; None for a miss, which awaits its own ticket), the
    flight it joins or starts, and a joiner's own deadline (`X-Clef-Deadline-Ms`)."""

    how: str
    answer: asyncio.Future[Outcome] | None = None
    flight: Flight | None = None
    deadline: float | None = None

    @property
    def admitted_elsewhere(self) -> bool:
        """A hit or a joiner: its answer is coming already, it is not admitted itself."""
        return self.answer is not None


def shareable(outcome: Outcome) -> bool:
    """Whether the shared request's outcome is handed to its joiners as theirs: a 200, or the
    500 of a request that failed twice (see the module docstring); anything else re-admits
    them."""
    if isinstance(outcome, Answer):
        return outcome.ok
    return outcome.kind is RefusalKind.FAILED


class AnswerCache:
    """The LRU of answers and the table of requests in flight, both by `identity`."""

    def __init__(self, entries: int, max_bytes: int = DEFAULT_CACHE_BYTES,
                 queue_timeout: float | None = None,
                 serving: Callable[[str, str], bool] = _always,
                 takes_now: Callable[[str], bool] = _never) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._queue_timeout = queue_timeout
        # Whether a ready worker serves a model ("": the base) with a fingerprint now: an
        # answer may be served from memory, or handed to a joiner, only then (the dispatcher's
        # `serves_weights`).
        self.serving = serving
        # Whether a request for a model would be sent to a worker at once if admitted now (the
        # dispatcher's `takes_now`): a request with its own deadline then runs on its own.
        self.takes_now = takes_now
        self._answers: OrderedDict[bytes, Kept] = OrderedDict()
        self._bytes = 0
        self._flights: dict[bytes, Flight] = {}
        self._joiners_waiting = 0

    @property
    def enabled(self) -> bool:
        return self.entries > 0

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def size_bytes(self) -> int:
        """What the kept answers cost in memory (`entry_bytes` each): the
        `clef_answer_cache_bytes` gauge. An int read, safe from the metrics port's thread."""
        return self._bytes

    @property
    def joiners_waiting(self) -> int:
        """Requests waiting now on an identical request's forward (the
        `clef_answer_cache_joiners` gauge). An int read, safe from the metrics port's thread."""
        return self._joiners_waiting

    # -- the decision ------------------------------------------------------------------------

    def share(self, key: bytes, *, priority: str, deadline: float | None,
              client_gone: Callable[[], bool], model: str = "") -> Shared:
        """A kept answer (HIT), an identical request in flight to join (COALESCED), or a new
        flight for this request, the first of its kind (MISS). `model` is the model the
        request names ("": the base): the model its kept answer records."""
        kept = self._answers.get(key)
        if kept is not None:
            if self.may_serve(kept.model, kept.weights):
                self._answers.move_to_end(key)
                return Shared(HIT, _done(kept.answer))
            self._drop(key)  # weights no ready worker serves for that model
        applies = earliest(deadline, time.monotonic(), self._queue_timeout)
        flight = self._flights.get(key)
        if flight is not None:
            outcome = flight.outcome
            if outcome is not None and outcome.done() and not outcome.cancelled():
                result = outcome.result()
                if (isinstance(result, Answer) and result.ok  # landing: as good as kept
                        and self.may_serve(flight.model, result.reply.weights)):
                    return Shared(COALESCED, _done(result))
            elif self._may_join(flight, priority, applies, own_deadline=deadline is not None,
                                model=model):
                self._joiners_waiting += 1  # until its wait ends (`answer`) or it leaves
                return Shared(COALESCED, flight.join(), flight, deadline)
        return Shared(MISS, flight=Flight(key, client_gone, model=model, priority=priority,
                                          deadline=applies))

    def may_serve(self, model: str, weights: str) -> bool:
        """The one rule for a kept answer: served only while a ready worker serves the model
        that scored it with the weights that scored it."""
        return self.serving(model, weights)

    def _may_join(self, flight: Flight, priority: str, deadline: float | None, *,
                  own_deadline: bool, model: str) -> bool:
        """Whether the flight's request, not yet answered, will answer this one as it would be
        answered on its own (`deadline`: the one that applies to it; `own_deadline`: it carries
        `X-Clef-Deadline-Ms`): at a worker whose weights are still served, unless this request
        has a deadline of its own and a worker would take it at once; or waiting in a class no
        lower with a deadline no earlier."""
        ticket = flight.ticket
        if flight.outcome is None or ticket is None or flight.outcome.done():
            return False  # not admitted yet, or given up
        if ticket.at_worker:
            weights = ticket.weights
            if weights is not None and not self.may_serve(flight.model, weights):
                return False  # on a worker a roll retired: its answer is that request's only
            # Alone it would be on a worker now, its deadline moot: it does not wait on a
            # forward already under way (that forward's answer would come no sooner).
            return not (own_deadline and self.takes_now(model))
        if flight.priority != priority and priority == INTERACTIVE:
            return False
        if flight.deadline is None:
            return True
        return deadline is not None and deadline <= flight.deadline

    # -- the flight ----------------------------------------------------------------------------

    def admitted(self, shared: Shared, ticket: TicketView,
                 abandon: Callable[[TicketView], None]) -> None:
        """The first of its kind was admitted (`ticket`, the dispatcher's view of it): others
        join its flight until it lands (a later first of its kind, admitted on its own, takes
        the table's place). Once nobody waits for it, it leaves the table and `abandon` takes
        it out of the queue."""
        flight = shared.flight
        assert flight is not None and shared.how == MISS
        flight.outcome, flight.ticket = ticket.outcome, ticket

        def give_up() -> None:
            self._forget(flight)
            abandon(ticket)

        flight.on_all_gone = give_up
        self._flights[flight.key] = flight

    def leave(self, shared: Shared) -> None:
        """A hit or a joiner is refused before it waits (the server drains): a joiner no longer
        waits on the shared forward."""
        if shared.flight is not None and shared.answer is not None:
            self._joiners_waiting -= 1
            shared.flight.leave(shared.answer)

    async def answer(self, shared: Shared, wait: Wait,
                     alone: Callable[[], Awaitable[Outcome]],
                     expired: Callable[[], None]) -> Outcome:
        """The request's answer, however it comes: the one call the pipeline makes for a request
        the cache decided on (`share`), once admitted (`admitted`) if it is the first of its kind.

        `wait` awaits a future while the client is watched (the connection's `wait_answer`:
        ClientGone if the client leaves); `alone` admits the request on its own and awaits its
        own ticket (a joiner whose shared request was not answered: it then counts as a miss);
        `expired` is told when a joiner's own deadline passes before the shared answer (it gets
        504 alone; the forward goes on for the others)."""
        flight = shared.flight
        if flight is None:  # a hit (or a late joiner handed a 200): nothing to give up
            assert shared.answer is not None
            return await wait(shared.answer, _nothing)
        if shared.answer is None:  # the first of its kind, admitted: it lands for everyone
            outcome = flight.outcome
            assert outcome is not None
            try:
                return await wait(outcome, functools.partial(_first_left, flight))
            finally:
                self._land(flight, outcome)
        mine = shared.answer  # a joiner, on its own future
        timer = _watch_deadline(mine, flight, shared.deadline, expired)
        try:
            handed = await wait(mine, functools.partial(flight.leave, mine))
        finally:
            self._joiners_waiting -= 1
            if timer is not None:
                timer.cancel()
        if handed is NOT_SHARED:  # the shared request was not answered: admitted on its own
            return await alone()
        return handed

    def _land(self, flight: Flight, outcome: asyncio.Future[Outcome]) -> None:
        """The first request's wait ended: hand its outcome to the joiners (a 200, else
        `NOT_SHARED`: see `shareable`) and keep a 200.

        Called by the first request itself (no callback per request); an outcome not yet set
        (the first request's task was cancelled another way) lands when it is."""
        if not outcome.done():
            outcome.add_done_callback(functools.partial(self._land, flight))
            return
        self._forget(flight)
        joiners = flight.joiners or ()
        if outcome.cancelled():  # every caller left (or the request was given up)
            for joiner in joiners:
                joiner.cancel()
            return
        result = outcome.result()
        served = not isinstance(result, Answer) or self.may_serve(flight.model,
                                                                   result.reply.weights)
        handed = result if served and shareable(result) else NOT_SHARED
        for joiner in joiners:
            if not joiner.done():
                joiner.set_result(handed)
        if isinstance(result, Answer) and result.ok and served:
            self._keep(flight.key, Kept(result, flight.model))

    def prune(self) -> int:
        """Forget the kept answers no ready worker's weights made (called when a worker
        becomes ready: weights replaced in place, a variant removed); how many went. A hit
        asks `may_serve` anyway: this only frees their memory sooner."""
        stale = [key for key, kept in self._answers.items()
                 if not self.may_serve(kept.model, kept.weights)]
        for key in stale:
            self._drop(key)
        return len(stale)

    # -- internals -----------------------------------------------------------------------------

    def _forget(self, flight: Flight) -> None:
        """The flight landed or was given up: identical requests from now on do not join it."""
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    def _keep(self, key: bytes, kept: Kept) -> None:
        """Keep an answer, then evict the least recently used past either bound (an answer
        larger than the byte bound alone is not kept)."""
        size = entry_bytes(key, kept)
        if size > self.max_bytes:
            return
        self._drop(key)
        self._answers[key] = kept
        self._bytes += size
        while len(self._answers) > self.entries or self._bytes > self.max_bytes:
            evicted, old = self._answers.popitem(last=False)
            self._bytes -= entry_bytes(evicted, old)  # the same objects: the same count

    def _drop(self, key: bytes) -> None:
        old = self._answers.pop(key, None)
        if old is not None:
            self._bytes -= entry_bytes(key, old)


def _watch_deadline(mine: asyncio.Future[Outcome], flight: Flight, deadline: float | None,
                    expired: Callable[[], None]) -> asyncio.TimerHandle | None:
    """A joiner's own deadline, judged as its own ticket's would be (the one deadline rule,
    clef_dispatch.past_deadline): when it passes while the shared request still waits for a
    worker, the joiner alone is refused (EXPIRED) and `expired` is told, and the request goes
    on for the others; while a worker holds the shared request the joiner is never expired,
    as a request on a worker never is, and its answer is awaited."""
    if deadline is None or mine.done():
        return None

    def due() -> None:
        if mine.done() or (flight.ticket is not None and flight.ticket.at_worker):
            return
        expired()
        mine.set_result(Refusal(RefusalKind.EXPIRED, SHARED_EXPIRED_DETAIL))
        flight.leave(mine)

    loop = asyncio.get_running_loop()
    return loop.call_at(loop.time() + deadline - time.monotonic(), due)


def _first_left(flight: Flight) -> None:
    """The client of a request others share left: given up if nobody else waits."""
    if flight.first_leaves():
        log.info("request_id=%s: client gone; its forward goes on for the identical requests "
                 "that share it", flight.ticket.request_id if flight.ticket else "-")


def _nothing() -> None:
    """What a request answered from the cache gives up when its client leaves."""


def _done(outcome: Outcome) -> asyncio.Future[Outcome]:
    answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    answer.set_result(outcome)
    return answer

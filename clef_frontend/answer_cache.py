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
of weights no ready worker serves is never returned from memory (it is dropped when found), and
the answers of weights still served survive a rolling restart. (A request that joins an
identical one already sent gets that forward's answer, as it would have had it been sent
itself then; the rule governs what is served from memory.) Answers are never shared across
keys, because a fast answer would tell one tenant what another asked.

`AnswerCache` owns the whole of sharing: the decision (`share`: a kept answer is a `hit`, an
identical request in flight is joined, `coalesced`, else this request is the first of its kind,
a `miss`), the flight's life once admitted (`admitted`), a joiner's own deadline
(`watch_deadline`), and the landing of the first request's outcome (`land`). Rules:

- Only a scored answer (a 200) is kept, and only a scored answer is handed to a request that
  joins late: a flight whose outcome is already set is joined only if that outcome is a 200.
- A joiner never receives another request's refusal: when the shared request is refused (its
  deadline passed, the queue was refused), each joiner is told `NOT_SHARED` and is admitted on
  its own. A worker's answer (a 200, the worker's 422, the 500 of a request that failed twice)
  is the request's own, and goes to every request that shares it.
- The kept answers are bounded twice: by count (`--answer-cache`) and by bytes
  (`--answer-cache-bytes`, the answers' bodies and keys), so one large answer cannot hold the
  memory of thousands and many cannot outgrow the bytes; the least recently used go first.

The first request waits on its ticket's outcome; each joiner waits on its own future, so one
client leaving (or one joiner's deadline passing) does not cancel the others'; the shared request
leaves the queue only once every caller of it has left.
"""

from __future__ import annotations

import asyncio
import hashlib
import marshal
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clef_dispatch import (
    INTERACTIVE,
    SHARED_EXPIRED_DETAIL,
    Answer,
    Outcome,
    Refusal,
    RefusalKind,
    earliest,
)

HIT, COALESCED, MISS = "hit", "coalesced", "miss"

# What a joiner is told when the request it shared was refused: admit yourself (never shown).
NOT_SHARED = Refusal(RefusalKind.UNAVAILABLE, "the shared request was refused")
# The default bound of the kept answers' bytes (`--answer-cache-bytes`).
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# What one kept entry costs beyond its body: the 32-byte key and the table's own objects.
_ENTRY_OVERHEAD = 32

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


def _size(answer: Answer) -> int:
    return len(answer.reply.body or b"") + _ENTRY_OVERHEAD


@dataclass(eq=False, slots=True)
class Flight:
    """A forward that identical requests share.

    Its first request waits on its own ticket's outcome, as a request does with the cache off
    (so a miss costs no future and no callback of its own); each request that joins it later
    waits on a future of its own, so that one caller leaving, or one caller's deadline passing,
    cancels nobody else's wait. The flight keeps its own record of what joining depends on,
    never reading the dispatcher's ticket: `first_gone` says whether the first request's client
    has left; `priority` and `deadline` are the first request's class and the deadline that
    applies to it (its own or the queue timeout, `clef_dispatch.earliest`); once it is admitted,
    `outcome` is the future its answer arrives on and `at_worker` says whether a worker holds
    it now (the dispatcher's answer); `on_all_gone` gives the request up once nobody waits.
    `model` is the model the request names ("": the base), which its kept answer records.
    """

    first_gone: Callable[[], bool]
    model: str = ""
    priority: str = INTERACTIVE
    deadline: float | None = None
    outcome: asyncio.Future[Outcome] | None = None
    at_worker: Callable[[], bool] | None = None
    on_all_gone: Callable[[], None] | None = None
    joiners: list[asyncio.Future[Outcome]] | None = None
    first_left: bool = False
    generation: int = 0

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
    """A kept answer and the model that scored it (its weights are `answer.reply.weights`)."""

    answer: Answer
    model: str

    @property
    def weights(self) -> str:
        return self.answer.reply.weights


def _always(model: str, weights: str) -> bool:
    """The default `serving`: every answer's weights are served (tests without workers)."""
    return True


@dataclass(frozen=True, slots=True)
class Shared:
    """How one request gets its answer: `how` (HIT, COALESCED or MISS), the future it awaits
    (a hit's, already set; a joiner's own) and the flight it joins or starts (a miss's: the
    first request then awaits its own ticket)."""

    how: str
    answer: asyncio.Future[Outcome] | None = None
    flight: Flight | None = None


class AnswerCache:
    """The LRU of answers and the table of requests in flight, both by `identity`."""

    def __init__(self, entries: int, max_bytes: int = DEFAULT_CACHE_BYTES,
                 queue_timeout: float | None = None,
                 serving: Callable[[str, str], bool] = _always) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._queue_timeout = queue_timeout
        # Whether a ready worker serves a model ("": the base) with a fingerprint now: a kept
        # answer may be served only then (the dispatcher's `serves_weights`).
        self.serving = serving
        self._answers: OrderedDict[bytes, Kept] = OrderedDict()
        self._bytes = 0
        self._flights: dict[bytes, Flight] = {}
        self._generation = 0  # bumped by `flush`: an answer begun before it is not kept

    @property
    def enabled(self) -> bool:
        return self.entries > 0

    def __len__(self) -> int:
        return len(self._answers)

    @property
    def size_bytes(self) -> int:
        """What the kept answers hold (bodies and keys): the `clef_answer_cache_bytes` gauge.
        An int read, safe from the metrics port's thread."""
        return self._bytes

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
            elif self._may_join(flight, priority, applies):
                return Shared(COALESCED, flight.join(), flight)
        return Shared(MISS, flight=Flight(client_gone, model=model, priority=priority,
                                          deadline=applies))

    def may_serve(self, model: str, weights: str) -> bool:
        """The one rule for a kept answer: served only while a ready worker serves the model
        that scored it with the weights that scored it."""
        return self.serving(model, weights)

    @staticmethod
    def _may_join(flight: Flight, priority: str, deadline: float | None) -> bool:
        """Whether the flight's request, not yet answered, will be answered no later and no
        lower than this one would be on its own (`deadline`: the one that applies to it): it is
        at a worker, or it waits in a class no lower with a deadline no earlier."""
        if flight.outcome is None or flight.at_worker is None or flight.outcome.done():
            return False  # not admitted yet, or given up
        if flight.at_worker():
            return True  # at a worker: its answer comes whatever happens
        if flight.priority != priority and priority == INTERACTIVE:
            return False
        if flight.deadline is None:
            return True
        return deadline is not None and deadline <= flight.deadline

    # -- the flight ----------------------------------------------------------------------------

    def admitted(self, key: bytes, flight: Flight, outcome: asyncio.Future[Outcome],
                 at_worker: Callable[[], bool], abandon: Callable[[], None]) -> None:
        """The first of its kind was admitted (its answer arrives on `outcome`; `at_worker`
        asks the dispatcher whether a worker holds it): others join its flight until it lands
        (a later first of its kind, admitted on its own, takes the table's place). Once nobody
        waits for it, it leaves the table and `abandon` takes it out of the queue."""
        flight.outcome, flight.at_worker = outcome, at_worker
        flight.generation = self._generation

        def give_up() -> None:
            self._forget(key, flight)
            abandon()

        flight.on_all_gone = give_up
        self._flights[key] = flight

    def watch_deadline(self, answer: asyncio.Future[Outcome], flight: Flight,
                       deadline: float | None,
                       expired: Callable[[], None]) -> asyncio.TimerHandle | None:
        """A joiner's own deadline: when it passes before the shared answer comes, the joiner
        alone is refused (EXPIRED) and `expired` is told; the forward goes on for the others."""
        if deadline is None or answer.done():
            return None

        def due() -> None:
            if answer.done():
                return
            expired()
            answer.set_result(Refusal(RefusalKind.EXPIRED, SHARED_EXPIRED_DETAIL))
            flight.leave(answer)

        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + deadline - time.monotonic(), due)

    def land(self, key: bytes, flight: Flight, outcome: asyncio.Future[Outcome]) -> None:
        """The first request's wait ended: hand its outcome to the joiners and keep a 200.

        Called by the first request itself (no callback per request); an outcome not yet set
        (the first request's task was cancelled another way) lands when it is."""
        if not outcome.done():
            outcome.add_done_callback(lambda done: self.land(key, flight, done))
            return
        self._forget(key, flight)
        joiners = flight.joiners or ()
        if outcome.cancelled():  # every caller left (or the request was given up)
            for joiner in joiners:
                joiner.cancel()
            return
        result = outcome.result()
        shared = NOT_SHARED if isinstance(result, Refusal) and result.kind in (
            RefusalKind.EXPIRED, RefusalKind.UNAVAILABLE) else result
        for joiner in joiners:
            if not joiner.done():
                joiner.set_result(shared)
        if isinstance(result, Answer) and result.ok and flight.generation == self._generation:
            self._keep(key, Kept(result, flight.model))

    def flush(self) -> None:
        """Forget every kept answer; answers now on their way are handed to their callers but
        not kept."""
        self._answers.clear()
        self._bytes = 0
        self._generation += 1

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

    def _forget(self, key: bytes, flight: Flight) -> None:
        """The flight landed or was given up: identical requests from now on do not join it."""
        if self._flights.get(key) is flight:
            del self._flights[key]

    def _keep(self, key: bytes, kept: Kept) -> None:
        """Keep an answer, then evict the least recently used past either bound (an answer
        larger than the byte bound alone is not kept)."""
        size = _size(kept.answer)
        if size > self.max_bytes:
            return
        self._drop(key)
        self._answers[key] = kept
        self._bytes += size
        while len(self._answers) > self.entries or self._bytes > self.max_bytes:
            _, evicted = self._answers.popitem(last=False)
            self._bytes -= _size(evicted.answer)

    def _drop(self, key: bytes) -> None:
        old = self._answers.pop(key, None)
        if old is not None:
            self._bytes -= _size(old.answer)


def _done(outcome: Outcome) -> asyncio.Future[Outcome]:
    answer: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
    answer.set_result(outcome)
    return answer

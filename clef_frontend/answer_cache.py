"""Duplicates answered once: identical requests in flight share one forward, and a bounded LRU
of answers answers repeats.

Identical means that the two answers must be byte for byte the same: the same key identity (its
name, `-` without auth) and the same parsed body in its own order (`identity`). Order is part
of a request: the questions' order is the prompt's order and the answer's order, and so are the
criteria's and the levels'; so the body is serialised as parsed, keys never sorted, and only what
parsing forgets (spacing, escapes) is ignored. The cache is flushed whenever the workers may have
loaded another snapshot (a reload, or a worker ready with a different snapshot). Answers are
never shared across keys, because a fast answer would tell one tenant what another asked. An
answer is a pure function of the request (the model is deterministic for a given snapshot),
which is what makes sharing it correct.

Only 200 answers are kept; every answer of a shared forward (200, 4xx or 5xx) goes to all who
share it. The first request waits on its ticket's outcome; each joiner waits on its own future,
so one client leaving (or one joiner's deadline passing) does not cancel the others'; the shared
request leaves the queue only once every caller of it has left.
"""

from __future__ import annotations

import asyncio
import hashlib
import marshal
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clef_frontend.responses import Reply

if TYPE_CHECKING:
    from clef_dispatch import Ticket

HIT, COALESCED, MISS = "hit", "coalesced", "miss"

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


@dataclass(eq=False, slots=True)
class Flight:
    """A forward that identical requests share.

    Its first request waits on its own ticket's outcome, as a request does with the cache off
    (so a miss costs no future and no callback of its own); each request that joins it later
    waits on a future of its own, so that one caller leaving, or one caller's deadline passing,
    cancels nobody else's wait. `first_gone` says whether the first request's client has left;
    `ticket` is the first request's place in admission (set once it is admitted);
    `on_all_gone` gives the request up once nobody waits for it.
    """

    first_gone: Callable[[], bool]
    ticket: Ticket | None = None
    on_all_gone: Callable[[], None] | None = None
    joiners: list[asyncio.Future[Reply]] | None = None
    first_left: bool = False
    generation: int = 0

    def join(self) -> asyncio.Future[Reply]:
        mine: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if self.joiners is None:
            self.joiners = []
        self.joiners.append(mine)
        return mine

    def all_gone(self) -> bool:
        """The first request's client has left and every joiner has its answer or has left
        (admission then never sends the request)."""
        if not (self.first_left or self.first_gone()):
            return False
        return self.joiners is None or all(joiner.done() for joiner in self.joiners)

    def leave(self, mine: asyncio.Future[Reply]) -> None:
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


class AnswerCache:
    """The LRU of answers and the table of requests in flight, both by `identity`."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._answers: OrderedDict[bytes, Reply] = OrderedDict()
        self._flights: dict[bytes, Flight] = {}
        self._generation = 0  # bumped by `flush`: an answer begun before it is not kept

    @property
    def enabled(self) -> bool:
        return self.entries > 0

    def __len__(self) -> int:
        return len(self._answers)

    def lookup(self, key: bytes) -> Reply | Flight | None:
        """A kept answer (hit), the flight to join (coalesced), or None (miss)."""
        answer = self._answers.get(key)
        if answer is not None:
            self._answers.move_to_end(key)
            return answer
        return self._flights.get(key)

    def start(self, key: bytes, flight: Flight) -> Flight:
        """The first of its kind was admitted: others join its flight until it `land`s (a
        later first of its kind, admitted on its own, takes the table's place)."""
        self._flights[key] = flight
        flight.generation = self._generation
        return flight

    def forget(self, key: bytes, flight: Flight) -> None:
        """The flight was given up: identical requests from now on are misses, not joiners."""
        if self._flights.get(key) is flight:
            del self._flights[key]

    def flush(self) -> None:
        """Forget every kept answer (the workers may have another snapshot); answers now on
        their way are handed to their callers but not kept."""
        self._answers.clear()
        self._generation += 1

    def land(self, key: bytes, flight: Flight, outcome: asyncio.Future[Reply]) -> None:
        """The first request's wait ended: hand its outcome to the joiners and keep a 200.

        Called by the first request itself (no callback per request); an outcome not yet set
        (the first request's task was cancelled another way) lands when it is."""
        if not outcome.done():
            outcome.add_done_callback(lambda done: self.land(key, flight, done))
            return
        self.forget(key, flight)
        joiners = flight.joiners or ()
        if outcome.cancelled():  # every caller left (or the request was given up)
            for joiner in joiners:
                joiner.cancel()
            return
        reply = outcome.result()
        for joiner in joiners:
            if not joiner.done():
                joiner.set_result(reply)
        if reply.status == 200 and flight.generation == self._generation:
            self._answers[key] = reply
            self._answers.move_to_end(key)
            while len(self._answers) > self.entries:
                self._answers.popitem(last=False)

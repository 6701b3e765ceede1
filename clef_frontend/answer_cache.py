"""Duplicates answered once: identical requests in flight share one forward, and a bounded LRU
of answers answers repeats.

Identical means that the two answers must be byte for byte the same: the same key identity (its
name, `-` without auth) and the same parsed body in its own order (`identity`). Order is part
of a request: the questions' order is the prompt's order and the answer's order, and so are the
criteria's and the levels'; so the body is re-encoded as parsed, keys never sorted, and only what
parsing forgets (spacing, escapes) is ignored. The cache is flushed whenever the workers may have
loaded another snapshot (a reload, or a worker ready with a different snapshot). Answers are
never shared across keys, because a fast answer would tell one tenant what another asked. An
answer is a pure function of the request (the model is deterministic for a given snapshot),
which is what makes sharing it correct.

Only 200 answers are kept; every answer of a shared forward (200, 4xx or 5xx) goes to all who
share it. Each caller waits on its own future, so one client leaving (or one caller's deadline
passing) does not cancel the others'; the shared request leaves the queue only once every caller
of it has left.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clef_frontend.responses import Reply

if TYPE_CHECKING:
    from clef_frontend.dispatch.admission import Ticket

HIT, COALESCED, MISS = "hit", "coalesced", "miss"

# Built once: `json.dumps` with any non-default option builds an encoder on every call, which
# costs more than the encoding of a typical request.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                            check_circular=False)  # a parsed document has no cycles


def identity(key_name: str, request: dict[str, Any]) -> bytes:
    """What two requests must share to share an answer: the key's name and the parsed body,
    re-encoded compactly in its own order, hashed (SHA-256, so the table holds 32 bytes a
    request whatever its size)."""
    body = _ENCODER.encode(request)
    digest = hashlib.sha256(key_name.encode("utf-8"))
    digest.update(b"\0")
    digest.update(body.encode("utf-8"))  # parse_body refuses lone surrogates
    return digest.digest()


@dataclass(eq=False)
class Flight:
    """A request in flight that identical ones share: one future per caller still waiting.

    `ticket` is the shared request's place in admission (set once it is admitted)."""

    callers: list[asyncio.Future[Reply]] = field(default_factory=list)
    on_all_gone: Callable[[], None] | None = None
    ticket: Ticket | None = None

    def join(self) -> asyncio.Future[Reply]:
        mine: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.callers.append(mine)
        return mine

    def all_gone(self) -> bool:
        """Every caller has its answer or has left (admission then never sends the request)."""
        return bool(self.callers) and all(caller.done() for caller in self.callers)

    def leave(self, mine: asyncio.Future[Reply]) -> None:
        """A caller is done waiting (its client left, its deadline passed): its wait ends; the
        last one out gives up the request."""
        if not mine.done():
            mine.cancel()
        if self.all_gone() and self.on_all_gone is not None:
            self.on_all_gone()


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

    def start(self, key: bytes, flight: Flight, outcome: asyncio.Future[Reply]) -> Flight:
        """The first of its kind was admitted: others join its flight until `outcome` is set
        (a later first of its kind, admitted on its own, takes the table's place)."""
        self._flights[key] = flight
        generation = self._generation
        outcome.add_done_callback(lambda done: self._landed(key, flight, done, generation))
        return flight

    def flush(self) -> None:
        """Forget every kept answer (the workers may have another snapshot); answers now on
        their way are handed to their callers but not kept."""
        self._answers.clear()
        self._generation += 1

    def _landed(self, key: bytes, flight: Flight, outcome: asyncio.Future[Reply],
                generation: int) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if outcome.cancelled():  # every caller left (or the request was given up)
            for caller in flight.callers:
                caller.cancel()
            return
        reply = outcome.result()
        for caller in flight.callers:
            if not caller.done():
                caller.set_result(reply)
        if reply.status == 200 and generation == self._generation:
            self._answers[key] = reply
            self._answers.move_to_end(key)
            while len(self._answers) > self.entries:
                self._answers.popitem(last=False)

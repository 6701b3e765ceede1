"""Duplicates answered once: identical requests in flight share one forward, and a bounded LRU
of answers answers repeats.

Identical means the same key identity (its name, `-` without auth), the same canonical body
(JSON with sorted keys and no insignificant whitespace, so `{"a":1, "b":2}` and `{"b": 2,
"a": 1}` match; bodies too large to re-encode inline are compared byte for byte) and the same
snapshot: the cache is flushed whenever the workers may have loaded another one (a reload, or a
worker ready with a different snapshot). Answers are never shared across keys, because a fast
answer would tell one tenant what another asked. An answer is a pure function of the request
(the model is deterministic for a given snapshot), which is what makes sharing it correct.

Only 200 answers are kept; every answer of a shared forward (200, 4xx or 5xx) goes to all who
share it. Each caller waits on its own future, so one client leaving does not cancel the others';
the shared request leaves the queue only once every caller of it has left.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clef_frontend.responses import Reply

HIT, COALESCED, MISS = "hit", "coalesced", "miss"


def request_key(key_name: str, body: bytes, request: dict[str, Any] | None = None) -> bytes:
    """The identity of a request for sharing: key name and canonical body, hashed.

    `request` is the body as validation already parsed it; given, it is re-encoded canonically
    (keys sorted), so the same request with its keys in another order shares. Without it the
    body's bytes are the identity (the caller leaves it out where re-encoding would stall the
    event loop)."""
    canonical = body
    if request is not None:
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False).encode("utf-8")
    digest = hashlib.sha256(key_name.encode("utf-8"))
    digest.update(b"\0")
    digest.update(canonical)
    return digest.digest()


@dataclass(eq=False)
class Flight:
    """A request in flight that identical ones share: one future per caller still waiting."""

    callers: list[asyncio.Future[Reply]] = field(default_factory=list)
    on_all_gone: Callable[[], None] | None = None

    def join(self) -> asyncio.Future[Reply]:
        mine: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.callers.append(mine)
        return mine

    def all_gone(self) -> bool:
        """Every caller's client has left (admission then never sends the request)."""
        return bool(self.callers) and all(caller.done() for caller in self.callers)

    def leave(self, mine: asyncio.Future[Reply]) -> None:
        """A caller's client has gone: cancel its wait; the last one out gives up the request."""
        if not mine.done():
            mine.cancel()
        if self.all_gone() and self.on_all_gone is not None:
            self.on_all_gone()


class AnswerCache:
    """The LRU of answers and the table of requests in flight, both by `request_key`."""

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
        """The first of its kind was admitted: others join its flight until `outcome` is set."""
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

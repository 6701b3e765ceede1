"""Timeouts of one fixed length for many connections, on one event-loop timer.

Every idle keep-alive connection waits for its next request with the same timeout, and every
awaited answer has its client watched after the same delay. With one length, deadlines come in
the order their entries were added, so the earliest deadline is always the oldest entry: a
queue in insertion order needs no heap. An entry costs a dict insert and a delete, where a timer
of its own (what `asyncio.timeout` and `loop.call_later` make) costs a handle, a push onto the
loop's heap (comparisons in Python) and a cancel, twice per request; the queue keeps a single
timer at its oldest deadline, and only while it holds entries, so at thousands of requests a
second it makes a few timers a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable

log = logging.getLogger("clef_frontend.timeout_queue")


class TimeoutQueue:
    """Calls each entry's callback `delay` seconds after it was added, unless discarded first.

    Used from the event loop's thread only; the loop is the one running at the first `add`.
    """

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self._entries: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Hashable, callback: Callable[[], None]) -> None:
        """(Re)start `key`'s timeout: `callback` runs `delay` seconds from now."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + self.delay
        entries = self._entries
        entries.pop(key, None)  # a restarted entry moves to the end, where its deadline belongs
        entries[key] = (deadline, callback)
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)

    def discard(self, key: Hashable) -> None:
        """`key`'s wait ended in time (its timer, if it is the oldest, fires and moves on)."""
        self._entries.pop(key, None)

    def _expire(self) -> None:
        """Run the callbacks whose deadline has come, then sleep until the next deadline."""
        self._timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        entries = self._entries
        while entries:
            key = next(iter(entries))
            deadline, callback = entries[key]
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                return
            del entries[key]
            try:
                callback()
            except Exception:  # one failing callback must not strand the others
                log.exception("a timeout callback failed")

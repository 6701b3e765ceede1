"""The start-up's stopwatch: the seconds of each phase (`clef_protocol.messages.STARTUP_PHASES`)
and the total, for `ready`, `/health` and the worker's ready log line.

Why: "ready in 135.8 s" says nothing about what to fix; per-phase figures say whether a slow
start was compiling kernels (capture), hashing weights, checking, or importing. The phases are
timed where they run (clef_worker.main, clef_worker.starting.warmup) on the one clock of this start
(`begin` makes it, `current` finds it), so the warm-up need not pass it around.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from clef_protocol.messages import STARTUP_PHASES, StartupTimes


class StartupClock:
    """One start-up's phases, timed from `origin` (a `time.perf_counter()` value)."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        # Every phase is reported, zero where it did not run (a release executor's capture).
        self.phases: dict[str, float] = dict.fromkeys(STARTUP_PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (added to what the phase already holds)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def since_origin(self, name: str) -> None:
        """Phase `name` is everything from the origin until now not yet given to a phase (the
        imports before the first timed phase)."""
        self.add(name, max(0.0, time.perf_counter() - self.origin - sum(self.phases.values())))

    def times(self) -> StartupTimes:
        """The total so far and each phase, in seconds (milliseconds kept)."""
        return StartupTimes(round(time.perf_counter() - self.origin, 3),
                            {name: round(seconds, 3) for name, seconds in self.phases.items()})


_current: StartupClock | None = None


def begin(origin: float | None = None) -> StartupClock:
    """Start timing this process's start-up (origin: now unless given) and make it `current`."""
    global _current
    _current = StartupClock(time.perf_counter() if origin is None else origin)
    return _current


def current() -> StartupClock:
    """The clock of the start-up under way (a throwaway one outside a start: a test warming an
    executor it built itself)."""
    return _current if _current is not None else StartupClock(time.perf_counter())

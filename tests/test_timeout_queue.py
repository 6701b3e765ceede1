"""The shared timeout queue: callbacks in deadline order, discarded entries never called, a
restarted entry timed from its restart, one loop timer however many entries."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from clef_frontend.timeout_queue import TimeoutQueue


def test_callbacks_run_in_order_and_discarded_ones_never() -> None:
    async def scenario() -> list[str]:
        queue = TimeoutQueue(0.02)
        fired: list[str] = []
        done = asyncio.Event()
        for name in ("a", "b", "c", "d"):
            queue.add(name, functools.partial(fired.append, name))
        queue.discard("b")
        queue.add("a", functools.partial(fired.append, "a again"))  # restarted: now the newest

        def last() -> None:
            fired.append("e")
            done.set()

        queue.add("e", last)
        await done.wait()
        assert len(queue) == 0
        return fired

    assert asyncio.run(scenario()) == ["c", "d", "a again", "e"]


def test_many_entries_share_one_timer_and_a_failing_callback_strands_none() -> None:
    async def scenario() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        timers = 0
        call_at = loop.call_at

        def counting_call_at(when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
            nonlocal timers
            timers += 1
            return call_at(when, callback, *args)

        loop.call_at = counting_call_at  # type: ignore[method-assign,assignment]
        queue = TimeoutQueue(0.01)
        fired: list[int] = []
        done = asyncio.Event()
        for number in range(1000):
            queue.add(number, functools.partial(fired.append, number))

        def boom() -> None:
            raise RuntimeError("a callback that fails")

        queue.add("boom", boom)
        queue.add("last", done.set)
        await done.wait()
        return timers, fired

    timers, fired = asyncio.run(scenario())
    assert fired == list(range(1000))
    # One timer for the first entry, then one more each time it fires before the rest are due:
    # the entries' deadlines span only the time it took to add them, so that is a handful (how
    # many depends on the machine's speed), never one per entry.
    assert timers < 100


def test_an_entry_fires_no_sooner_than_its_delay() -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        queue = TimeoutQueue(0.05)
        fired = loop.create_future()
        started = loop.time()
        queue.add("x", lambda: fired.set_result(loop.time()))
        return float(await fired) - started

    assert asyncio.run(scenario()) >= 0.05

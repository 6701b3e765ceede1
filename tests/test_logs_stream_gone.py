"""The front's log lines when stderr can no longer be written (the pipe's reader gone, a full
disk): the lines are lost and the server serves on; the failed write is never raised into the
event loop, whose error report would go to the same broken stream at the end of every turn."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator

import pytest

from clef_frontend import logs


class BrokenStream(io.StringIO):
    """A text stream whose every write fails as a closed pipe's does."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0

    def write(self, text: str) -> int:
        self.attempts += 1
        raise BrokenPipeError(32, "Broken pipe")


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """`configure` replaces the handlers of the root logger and the server's loggers."""
    names = ("", *logs.LOGGERS)
    saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).level,
                    logging.getLogger(name).propagate) for name in names}
    yield
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:], logger.propagate = handlers, propagate
        logger.setLevel(level)
    logs._text_sink = None


def test_a_broken_stream_costs_one_write_per_turn_that_logs_and_raises_nothing(
        restored_logging: None) -> None:
    stream = BrokenStream()
    logs.configure("INFO", "text")
    handler = logging.getLogger(logs.LOGGERS[0]).handlers[0]
    assert isinstance(handler, logs.BatchingHandler)
    handler.setStream(stream)
    reported: list[dict[str, object]] = []

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        # What the loop would log through the same handler; recorded here so the test sees it.
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        logging.getLogger("clef_frontend.test").warning("one line")
        for _ in range(20):  # turns with nothing logged
            await asyncio.sleep(0)
        logs.request_line(method=b"GET", target=b"/health", status=200, queue_ms=None,
                          worker_ms=None, bytes_in=0, bytes_out=2, client="127.0.0.1")
        for _ in range(20):
            await asyncio.sleep(0)

    asyncio.run(serve())
    assert reported == []  # nothing raised into the loop
    assert stream.attempts == 2  # one write for each turn that logged, none retried
    assert handler.lost_writes == 2


def test_the_default_exception_handler_does_not_feed_a_write_loop(
        restored_logging: None) -> None:
    """Without a handler of the test's own: had the failed write been raised, asyncio's default
    handler would have logged it through the broken stream again, turn after turn."""
    stream = BrokenStream()
    logs.configure("INFO", "text")
    handler = logging.getLogger(logs.LOGGERS[0]).handlers[0]
    assert isinstance(handler, logs.BatchingHandler)
    handler.setStream(stream)

    async def serve() -> None:
        logging.getLogger("clef_frontend.test").warning("one line")
        for _ in range(50):
            await asyncio.sleep(0)

    asyncio.run(serve())
    assert stream.attempts == 1

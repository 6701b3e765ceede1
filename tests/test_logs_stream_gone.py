"""The front's log lines when stderr can no longer be written (the pipe's reader gone, a full
disk): the lines are lost and the server serves on; the failed write is never raised into the
event loop, whose error report would go to the same broken stream at the end of every turn."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchlib.paths import FAKE_WORKER
from benchlib.serve import LISTENING
from clef_frontend import logs
from tests.frontend_helpers import REPO, WAIT, clef_body


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
    assert handler.lost_writes == logs.lost_writes() == 2  # what the metric reads


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


def test_a_front_whose_stderr_reader_left_serves_on_and_counts_the_lost_writes() -> None:
    """The real server, production defaults (the fake worker): its stderr pipe's reader closes
    once the port is open; requests are still answered and the lost writes are counted."""
    process = subprocess.Popen(
        [sys.executable, "-m", "clef_frontend", "--port", "0", "--worker-command",
         shlex.join([sys.executable, str(FAKE_WORKER)])],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert process.stderr is not None
        port = 0
        for line in process.stderr:
            match = LISTENING.search(line)
            if match:
                port = int(match["port"])
                break
        assert port, "the server never said it was listening"
        process.stderr.close()  # whatever read the server's stderr is gone
        base = f"http://127.0.0.1:{port}"
        for _ in range(3):  # each answer writes an access line: refused
            with urllib.request.urlopen(f"{base}/health", timeout=WAIT) as response:
                assert response.status == 200
        request = urllib.request.Request(f"{base}/v1/systemone", data=clef_body(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{base}/metrics", timeout=WAIT) as response:
            text = response.read().decode()
        lost = [sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "clef_log_writes_lost_total"]
        assert lost and lost[0] >= 4  # the three /health lines and the POST's, at least
        assert process.poll() is None  # still serving
    finally:
        process.terminate()
        process.wait(WAIT)

"""Log set-up and the one-line-per-request access log, all on stderr.

Lines are `key=value` so they can be grepped and parsed; request bodies never appear (they are
client data, can be megabytes, and may be confidential). The worker inherits our stderr, so its
own lines interleave with these, each line whole.

The access log is written once per request, so its cost is part of every request's: lines are
formatted with a timestamp text made once per second, and the lines of one event-loop turn are
written together, with one write, when that turn ends (`BatchingHandler`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TextIO

FORMAT = "%(asctime)s clef-serve[%(process)d] %(levelname)s %(message)s"
_TARGET_CHARS = 200

access = logging.getLogger("clef_frontend.access")


class _Formatter(logging.Formatter):
    """The standard format and timestamps, with the date and time text made once a second."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(second))
        return f"{self._stamp},{int(record.msecs):03d}"  # as logging: 2026-01-31 12:00:00,042


class BatchingHandler(logging.StreamHandler[TextIO]):
    """Lines logged during one event-loop turn are written with one write when it ends.

    Outside a running loop (start-up, shutdown, other threads) each line is written at once.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._scheduled = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._pending.append(line)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._scheduled = False
            if self._pending:
                text = "".join(self._pending)
                self._pending.clear()
                self.stream.write(text)
                self.stream.flush()


def configure(level: str = "INFO") -> None:
    """Route every `clef_frontend.*` logger to stderr with one format."""
    handler = BatchingHandler(sys.stderr)
    handler.setFormatter(_Formatter(FORMAT))
    root = logging.getLogger("clef_frontend")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # The logging HOWTO's "Optimization" switches for what our format never shows: each
    # record then skips the caller lookup (a walk up the stack) and the thread and
    # multiprocessing lookups. The access log makes a record per request.
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False


def printable(raw: bytes) -> str:
    """A request target as a safe log token: ASCII, escaped, bounded."""
    text = raw[:_TARGET_CHARS].decode("ascii", "backslashreplace")
    return text + ("..." if len(raw) > _TARGET_CHARS else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def request_line(
    *,
    method: bytes,
    target: bytes,
    status: int,
    queue_ms: float | None,
    worker_ms: float | None,
    bytes_in: int,
    bytes_out: int,
    client: str,
    request_id: str = "-",
    batch: int | None = None,
    key: str = "-",
) -> None:
    """`request method=POST path=/v1/systemone status=200 queue_ms=0.3 worker_ms=41.2 batch=4
    ...` (`batch`: requests in the worker forward that answered it; its `worker_ms` is that
    forward's; `key`: the API key's name, `-` without one)."""
    access.info(
        "request method=%s path=%s status=%d queue_ms=%s worker_ms=%s batch=%s bytes_in=%d "
        "bytes_out=%d client=%s key=%s request_id=%s",
        printable(method), printable(target), status, _ms(queue_ms), _ms(worker_ms),
        "-" if batch is None else batch, bytes_in, bytes_out, client, key, request_id,
    )

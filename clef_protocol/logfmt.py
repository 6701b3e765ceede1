"""The JSON log line both processes write with `--log-format json`: one object per line.

Front and worker share stderr, so a collector (Vector, Fluent Bit, Loki's promtail) reads one
stream; one shape for both lets a single parser rule handle every line, and the request id
joins a worker line to its access line. Keys, in this order:

    time        ISO 8601, UTC, milliseconds ("2026-01-31T12:00:00.042Z")
    level       DEBUG, INFO, WARNING, ERROR, CRITICAL
    logger      the logging logger's name ("clef_frontend.access", "clef_worker", ...)
    message     the formatted message
    request_id  the request being served when the line was written (absent outside requests)
    trace_id    its W3C trace id (32 hex digits, or "-" when none is known)
    ...         further fields of the line (the access line's method, path, status, ...)
    exception   the traceback, when the record carries one

The standard library's `logging.Formatter` with `json.dumps` is all it takes: the fields are
few and flat, so a formatter package would add a dependency without removing code.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")

# A LogRecord attribute holding a dict of extra fields for the line (`extra={FIELDS: {...}}`).
FIELDS = "clef_fields"


def utc_stamp(created: float) -> str:
    """`created` (seconds since the epoch) as `2026-01-31T12:00:00.042Z`."""
    whole = int(created)
    millis = int((created - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def json_line(created: float, level: str, logger: str, message: str,
              **fields: Any) -> str:
    """One line in the shape above, for text that did not come through `logging` (a stray
    write to stderr) as much as for records."""
    document: dict[str, Any] = {"time": utc_stamp(created), "level": level, "logger": logger,
                                "message": message}
    document.update(fields)
    return json.dumps(document, ensure_ascii=False, default=str)


class JsonFormatter(logging.Formatter):
    """A LogRecord as one JSON object (see the module docstring for the keys).

    `request_id` and `trace_id` come from record attributes of those names (set by each
    process's filter from its request context, or passed in `extra`); further fields from the
    `FIELDS` attribute.
    """

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {}
        request_id = getattr(record, "request_id", None)
        if request_id:
            fields["request_id"] = request_id
        trace_id = getattr(record, "trace_id", None)
        if trace_id:
            fields["trace_id"] = trace_id
        extra = getattr(record, FIELDS, None)
        if extra:
            fields.update(extra)
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            fields["exception"] = record.exc_text
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        return json_line(record.created, record.levelname, record.name, record.getMessage(),
                         **fields)


class JsonLinesStream(io.TextIOBase):
    """A text stream that turns whatever is written to it into JSON lines on `target`.

    Installed as `sys.stderr` (and `sys.stdout`) in JSON mode, it catches what bypasses the
    logging set-up: a library's `print`, a handler a library attached to the old `sys.stderr`,
    a traceback printed by hand. A line that already is a JSON object passes unchanged; any
    other line becomes a `logger: <name>` record of level WARNING (such writes are warnings or
    worse far more often than not). Text without a newline waits for the rest of its line.
    Writes to file descriptor 2 from native code do not pass through Python: the worker
    catches those with a pipe (clef_worker.logs).
    """

    def __init__(self, target: TextIO, name: str) -> None:
        super().__init__()
        self._target = target
        self._name = name
        self._partial = ""
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", None) or "utf-8"

    def retarget(self, target: TextIO) -> None:
        """Write to `target` from now on (the worker moves stderr to a private descriptor)."""
        with self._lock:
            self._target = target

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._target.fileno()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            out = [self._wrap(line) for line in lines if line.strip()]
            if out:
                self._target.write("\n".join(out) + "\n")
                self._target.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self._target.flush()

    def close(self) -> None:
        """Write a last unterminated line, if any (the stream itself stays with its owner)."""
        with self._lock:
            if self._partial.strip():
                self._target.write(self._wrap(self._partial) + "\n")
                self._target.flush()
            self._partial = ""

    def _wrap(self, line: str) -> str:
        if line.startswith("{"):
            try:
                if isinstance(json.loads(line), dict):
                    return line
            except ValueError:
                pass
        return json_line(time.time(), "WARNING", self._name, line.rstrip("\r"))


def capture_stray_output() -> TextIO:
    """JSON mode's safety net: `sys.stderr` (and `sys.stdout` where it is the same stream, as in
    the worker) become `JsonLinesStream`s, Python warnings go through logging, and uncaught
    exceptions are logged as one record rather than printed line by line.

    Returns the real stderr, where the process's own log handler writes. Idempotent.
    """
    real = sys.stderr
    if isinstance(real, JsonLinesStream):
        real = real._target
    elif sys.stdout is real:
        sys.stdout = JsonLinesStream(real, "stdout")
    if not isinstance(sys.stderr, JsonLinesStream):
        sys.stderr = JsonLinesStream(real, "stderr")
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    return real


def _log_uncaught(kind: type[BaseException], value: BaseException,
                  traceback: TracebackType | None) -> None:
    logging.getLogger("uncaught").critical("uncaught exception", exc_info=(kind, value, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit or args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("uncaught").error(
        "uncaught exception in thread %s", name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

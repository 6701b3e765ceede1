"""Log set-up and the one-line-per-request access log, all on stderr.

Lines are `key=value` so they can be grepped and parsed; request bodies never appear (they are
client data, can be megabytes, and may be confidential). The worker inherits our stderr, so its
own lines interleave with these, each line whole.

The access log is written once per request, so its cost is part of every request's: lines are
formatted with a timestamp text made once per second, and the lines of one event-loop turn are
written together, with one write, when that turn ends (`BatchingHandler`). In text format the
access line skips the logging machinery (a record, filters, a %-format) that cost more than the
rest of a `/health` answer: it is formatted once, in the same layout, and queued on the handler.

With `--log-format json` every line is one JSON object instead (`clef_protocol.logfmt`, the
shape the worker writes too): the access line's fields become keys, and any line written while
a request is being served carries its `request_id` and `trace_id` (`bind_request`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import sys
import time
from typing import TextIO

from clef_protocol.logfmt import FIELDS, JsonFormatter, capture_stray_output

FORMAT = "%(asctime)s clef-serve[%(process)d] %(levelname)s %(message)s"
_TARGET_CHARS = 200

access = logging.getLogger("clef_frontend.access")
# The server's own loggers, whose lines `configure` writes at the chosen level: the front's and
# the dispatch package's (the workers' supervision).
LOGGERS = ("clef_frontend", "clef_dispatch")

# (request id, trace id) of the request the current task serves; one task per connection.
_request: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "clef_request", default=None)
_structured = False  # --log-format json: the access line's fields go to the formatter as keys
# Text format: where the access line goes without a LogRecord, and its fixed prefix parts.
_text_sink: tuple[BatchingHandler, _Formatter, str] | None = None


class _Formatter(logging.Formatter):
    """The standard format and timestamps, with the date and time text made once a second."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return self.stamp(record.created)

    def stamp(self, created: float) -> str:
        """`created` (time.time()) as logging writes `asctime`: 2026-01-31 12:00:00,042."""
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(second))
        return f"{self._stamp},{int((created - second) * 1000):03d}"


class BatchingHandler(logging.StreamHandler[TextIO]):
    """Lines logged during one event-loop turn are written with one write when it ends.

    Outside a running loop (start-up, shutdown, other threads) each line is written at once.
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self._pending: list[str] = []
        self._scheduled = False
        self.lost_writes = 0  # writes the stream refused: their lines are gone

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        self.write_line(line)

    def write_line(self, line: str) -> None:
        """Queue one formatted line (without its terminator) for the end of this turn."""
        self._pending.append(line + self.terminator)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the queued lines. A stream that can no longer be written (the reader of our
        stderr pipe gone, a full disk) loses them, and nothing is raised: raised from the loop's
        callback, asyncio would log the error through this same handler, which queues it and
        fails again at the end of the next turn, one traceback formatted per turn, forever (a
        server with a closed stderr once spun a core that way). The server serves on."""
        with self.lock:  # type: ignore[union-attr]
            self._scheduled = False
            if self._pending:
                text = "".join(self._pending)
                self._pending.clear()
                try:
                    self.stream.write(text)
                    self.stream.flush()
                except (OSError, ValueError):  # ValueError: the stream was closed
                    self.lost_writes += 1


class RequestFilter(logging.Filter):
    """Adds `request_id` and `trace_id` to a record written while a request is served."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _request.get()
        if bound is not None and not hasattr(record, "request_id"):
            record.request_id, record.trace_id = bound
        return True


def lost_writes() -> int:
    """Writes of log lines the stream refused since start-up (`clef_log_writes_lost_total`):
    with stderr gone, the metric is where an operator can still see it."""
    return sum(getattr(handler, "lost_writes", 0)
               for handler in logging.getLogger(LOGGERS[0]).handlers)


def flush() -> None:
    """Write the lines queued in this event-loop turn now: before something else writes to the
    same stream meanwhile (a stuck worker's stack, written by the worker itself)."""
    for handler in logging.getLogger(LOGGERS[0]).handlers:
        handler.flush()


def bind_request(request_id: str, trace_id: str) -> None:
    """Tag the current task's log lines (JSON) with this request until `unbind_request`."""
    _request.set((request_id, trace_id))


def unbind_request() -> None:
    """The request is answered: the connection's later lines are about no request."""
    _request.set(None)


def configure(level: str = "INFO", log_format: str = "text") -> None:
    """Route every `clef_frontend.*` and `clef_dispatch.*` logger to stderr with one format
    and level; other libraries' warnings (asyncio, the OpenTelemetry SDK) go the same way."""
    global _structured, _text_sink
    _structured = log_format == "json"
    _text_sink = None
    if _structured:
        handler = BatchingHandler(capture_stray_output())
        handler.setFormatter(JsonFormatter())
        handler.addFilter(RequestFilter())
    else:
        handler = BatchingHandler(sys.stderr)
        formatter = _Formatter(FORMAT)
        handler.setFormatter(formatter)
        _text_sink = (handler, formatter, f" clef-serve[{os.getpid()}] INFO request ")
    for name in LOGGERS:
        root = logging.getLogger(name)
        root.handlers[:] = [handler]
        root.setLevel(level)
        root.propagate = False
    everything = logging.getLogger()
    everything.handlers[:] = [handler]
    everything.setLevel(logging.WARNING)
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
    trace_id: str = "-",
    key: str = "-",
    cache: str | None = None,
    tenant: str = "-",
    model: str | None = None,
    weights: str | None = None,
    reused: int | None = None,
) -> None:
    """`request method=POST path=/v1/systemone status=200 queue_ms=0.3 worker_ms=41.2 batch=4
    ... key=rag-ingest cache=miss tenant=- trace_id=4bf9... request_id=...` (`batch`: requests
    in the worker forward that answered it; its `worker_ms` is that forward's; `key`: the API
    key's name, `-` without one; `cache`: the answer cache's `hit`, `coalesced` (shared an
    identical request's forward: no queue or worker time of its own) or `miss`, `-` when not
    looked up; `tenant`: the inference gateway's fairness id, gateway.py, `-` without one;
    `trace_id`: the W3C trace, `-` when none is known; `model`, only with fine-tuned variants
    served: the body's model, i.e. the variant or base name that scored it; `weights`: the short
    digest of the weights that made the answer, as its `Clef-Weights` header, `-` when none
    answered); `reused`: the prompt tokens its worker's prefix cache gave the forward that
    answered it, as Server-Timing's `prefix;desc="reused=N"` (`-` when the cache was not looked
    up: off, a shared answer, no worker reply).

    In JSON the same fields are keys of the line (numbers as numbers, unknown ones null)."""
    if _structured:
        access.info("request", extra={"request_id": request_id, "trace_id": trace_id, FIELDS: {
            "method": printable(method), "path": printable(target), "status": status,
            "queue_ms": _round(queue_ms), "worker_ms": _round(worker_ms), "batch": batch,
            "bytes_in": bytes_in, "bytes_out": bytes_out, "client": client, "key": key,
            "cache": cache, "tenant": tenant, "weights": weights, "reused": reused,
            **({"model": model} if model is not None else {})}})
        return
    fields = (
        f"method={printable(method)} path={printable(target)} status={status} "
        f"queue_ms={_ms(queue_ms)} worker_ms={_ms(worker_ms)} "
        f"batch={'-' if batch is None else batch} bytes_in={bytes_in} bytes_out={bytes_out} "
        f"client={client} key={key} cache={cache or '-'} tenant={tenant} "
        f"{'' if model is None else f'model={printable(model.encode())} '}"
        f"weights={weights or '-'} reused={'-' if reused is None else reused} "
        f"trace_id={trace_id} request_id={request_id}")
    sink = _text_sink
    if sink is not None and access.isEnabledFor(logging.INFO):
        handler, formatter, prefix = sink
        handler.write_line(formatter.stamp(time.time()) + prefix + fields)
        return
    access.info("request %s", fields)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)

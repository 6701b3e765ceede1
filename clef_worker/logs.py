"""The worker's log set-up: stderr lines that name the request they are about.

While a request is being answered, every log record (the loop's, the executor's, a library's)
carries `request_id=<the front's X-Request-Id>`, so a failure in the worker log can be matched
to the access-log line and to what the client saw. The id comes from the request frame's
`trace_id`; a context variable holds it for the length of the request.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from typing import TextIO

from clef_protocol.messages import is_trace_id

FORMAT = "%(asctime)s clef-worker[%(process)d] %(levelname)s %(trace)s%(message)s"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)


class TraceFilter(logging.Filter):
    """Adds `record.trace`: `request_id=... ` during a request, empty otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id = _current.get()
        record.trace = f"request_id={trace_id} " if trace_id else ""
        return True


def configure(stream: TextIO | None = None, level: int = logging.INFO) -> logging.Handler:
    """Send every log record to stderr (or `stream`) in the worker's format."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TraceFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler


@contextlib.contextmanager
def request_context(trace_id: object) -> Iterator[None]:
    """Tag log records with `trace_id` while the block runs; an id that breaks the rule (the
    worker trusts no input) is logged as `-` rather than written into the log verbatim."""
    token = _current.set(trace_id if isinstance(trace_id, str) and is_trace_id(trace_id) else "-")
    try:
        yield
    finally:
        _current.reset(token)

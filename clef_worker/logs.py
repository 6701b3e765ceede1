"""The worker's log set-up: stderr lines that name the request they are about.

While a request is being answered, every log record (the loop's, the executor's, a library's)
carries `request_id=<the front's X-Request-Id>`, so a failure in the worker log can be matched
to the access-log line and to what the client saw. The id comes from the request frame's
`trace_id`; a context variable holds it for the length of the request.

With `--log-format json` the lines are the front's JSON shape (`clef_protocol.logfmt`), the
request id a key of its own; the worker is not told the W3C trace id, so its lines join a trace
through the front's access line, which carries both. Everything else that reaches stderr in
Python (the model libraries' own handlers, warnings, stray prints, which `stdio` sends to
stderr) is turned into JSON lines as well, and so is what native code writes to file
descriptors 1 and 2 (a C++ library's warning, a compiler the kernels run): those descriptors
become a pipe whose lines a thread wraps (`_capture_descriptors`). A collector never meets a
line it cannot parse.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import contextvars
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from clef_protocol.logfmt import JsonFormatter, JsonLinesStream, capture_stray_output
from clef_protocol.messages import is_trace_id

FORMAT = "%(asctime)s clef-worker[%(process)d] %(levelname)s %(trace)s%(message)s"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("trace_id", default=None)


class TraceFilter(logging.Filter):
    """Adds `record.trace` (`request_id=... ` during a request, empty otherwise) for the text
    format and `record.request_id` for the JSON one."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id = _current.get()
        record.trace = f"request_id={trace_id} " if trace_id else ""
        if trace_id and not hasattr(record, "request_id"):
            record.request_id = trace_id
        return True


def configure(stream: TextIO | None = None, level: int = logging.INFO,
              log_format: str = "text") -> logging.Handler:
    """Send every log record to stderr (or `stream`) in the worker's format (text or json)."""
    if log_format == "json":
        real_stderr = _capture_descriptors(capture_stray_output())
        handler = logging.StreamHandler(stream if stream is not None else real_stderr)
        handler.setFormatter(JsonFormatter())
        _adopt_transformers_logging()
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TraceFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return handler


_captured: TextIO | None = None  # the real stderr once descriptors 1 and 2 are captured


def _capture_descriptors(real_stderr: TextIO) -> TextIO:
    """Point fds 1 and 2 at a pipe and wrap its lines as JSON on a private copy of stderr.

    Returns that copy (the log handler and `sys.stderr`'s wrapper write there directly, so the
    worker's own lines never wait for the thread). At exit the pipe is closed and drained.
    """
    global _captured
    if _captured is not None:
        return _captured
    real_stderr.flush()
    copy = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    if isinstance(sys.stderr, JsonLinesStream):
        sys.stderr.retarget(copy)
    if isinstance(sys.stdout, JsonLinesStream):
        sys.stdout.retarget(copy)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.dup2(write_end, 2)
    os.close(write_end)
    wrapper = JsonLinesStream(copy, "stderr")
    pump = threading.Thread(target=_pump, args=(read_end, wrapper), daemon=True,
                            name="stderr-json")
    pump.start()

    def drain() -> None:
        os.dup2(copy.fileno(), 1)  # the pipe's last write ends close: the pump reads EOF
        os.dup2(copy.fileno(), 2)
        pump.join(1.0)

    atexit.register(drain)
    _captured = copy
    return copy


def _pump(read_end: int, wrapper: JsonLinesStream) -> None:
    """Copy the pipe to `wrapper` until EOF (a character split between reads stays whole)."""
    decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            wrapper.write(decoder.decode(chunk))
    wrapper.write(decoder.decode(b"", final=True))
    wrapper.close()


def _adopt_transformers_logging() -> None:
    """transformers writes through a handler of its own on `sys.stderr` and does not propagate;
    send its records to ours instead, so they keep their level and logger name."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


@contextlib.contextmanager
def request_context(trace_id: object) -> Iterator[None]:
    """Tag log records with `trace_id` while the block runs; an id that breaks the rule (the
    worker trusts no input) is logged as `-` rather than written into the log verbatim."""
    token = _current.set(trace_id if isinstance(trace_id, str) and is_trace_id(trace_id) else "-")
    try:
        yield
    finally:
        _current.reset(token)

"""The worker's log set-up: stderr lines that name the request they are about.

While a request is being answered, every log record (the loop's, the executor's, a library's)
carries `request_id=<the front's X-Request-Id>` and, when the request is traced,
`trace_id=<its W3C trace id>`, so a failure in the worker log can be matched to the access-log
line, to what the client saw, and to the request's trace. Both come from the request frame; a
context variable holds them for the length of the request.

With `--log-format json` the lines are the front's JSON shape (`clef_protocol.logfmt`), the
request id and the trace id keys of their own. `enable_stack_dumps` makes the worker write every
thread's stack to its stderr on `STACK_DUMP_SIGNAL` (and exit, in the text format), which the
front asks of a worker it is about to kill as hung or stalled. Everything else that reaches
stderr in Python (the model libraries' own handlers, warnings, stray prints, which `stdio`
sends to stderr) is turned into JSON lines as well, and so is what native code writes to file
descriptors 1 and 2 (a C++ library's warning, a compiler the kernels run): those descriptors
become a pipe whose lines a thread wraps (`_capture_descriptors`). A collector never meets a
line it cannot parse.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import contextvars
import faulthandler
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from clef_protocol.logfmt import JsonFormatter, JsonLinesStream, capture_stray_output
from clef_protocol.messages import STACK_DUMP_SIGNAL, is_request_id, is_trace_id

FORMAT = "%(asctime)s clef-worker[%(process)d] %(levelname)s %(trace)s%(message)s"

# The request being answered: (request_id, trace_id); the trace id is "" when not traced.
_current: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "request", default=None)


class TraceFilter(logging.Filter):
    """Adds `record.trace` (`request_id=... [trace_id=...] ` during a request, empty otherwise)
    for the text format, and `record.request_id` and `record.trace_id` for the JSON one."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _current.get()
        if current is None:
            record.trace = ""
            return True
        request_id, trace_id = current
        record.trace = (f"request_id={request_id} "
                        + (f"trace_id={trace_id} " if trace_id else ""))
        if not hasattr(record, "request_id"):
            record.request_id = request_id
            if trace_id:
                record.trace_id = trace_id
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
def request_context(request_id: object, trace_id: object = "") -> Iterator[None]:
    """Tag log records with the request's ids while the block runs; a request id that breaks
    the rule (the worker trusts no input) is logged as `-` rather than written into the log
    verbatim, and a trace id that is not one is left out."""
    token = _current.set((
        request_id if isinstance(request_id, str) and is_request_id(request_id) else "-",
        trace_id if isinstance(trace_id, str) and is_trace_id(trace_id) else ""))
    try:
        yield
    finally:
        _current.reset(token)


def enable_stack_dumps() -> None:
    """On `STACK_DUMP_SIGNAL`, write every thread's Python stack to stderr, then exit.

    faulthandler writes from the signal handler itself, in C, so the stack comes out even while
    the main thread is stuck inside a C call (a driver call, a deadlocked kernel launch) and
    never takes the GIL; it then chains to the signal's default action, which ends the process
    (the front was about to kill it anyway). With `--log-format json` descriptor 2 is the pipe
    `_capture_descriptors` wraps into JSON lines, read by a thread of this process: exiting at
    once would lose the stack in the pipe, so there the worker carries on and the front's
    SIGKILL, `STACK_DUMP_SECONDS` later, ends it once the thread has had time to pass it on.
    """
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.__stderr__ or sys.stderr,
                          all_threads=True, chain=_captured is None)

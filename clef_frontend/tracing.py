"""Following one request: its id (`X-Request-Id`) and where its time went (`Server-Timing`).

The id is the client's (or the balancer's) `X-Request-Id` when it is printable ASCII without
spaces and at most 128 characters (`clef_protocol.messages.is_request_id`, the rule the worker
checks too); otherwise, or when absent, a fresh one is made. It is echoed on every response,
written on the access-log line, and sent to the worker as the request frame's `request_id`, which
puts it on every worker log line about that request.

A request may also belong to a distributed trace: W3C Trace Context's `traceparent` (and its
companion `tracestate`) name the trace and the caller's span. `trace_context_of` reads them
with the request id in one pass over the headers; `parse_traceparent` applies the
specification's rules, and a header that breaks them is ignored (the request starts a trace of
its own, as the specification asks). The OpenTelemetry side (spans, export) is `otel.py`; the
trace id also appears on the access line whether or not spans are exported.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable
from dataclasses import dataclass

from clef_protocol.messages import is_request_id

HEADER = "X-Request-Id"
_HEADER_KEY = HEADER.lower().encode("ascii")
_TRACEPARENT = b"traceparent"
_TRACESTATE = b"tracestate"
_LOWER_HEX = frozenset(string.hexdigits.lower())
# Level 1: `tracestate` holds at most 32 list members; 512 characters is the size a vendor
# must at least propagate. Anything longer is dropped rather than carried into every span.
TRACESTATE_MAX_CHARS = 512
NO_TRACE = "-"  # the access log's trace_id when no trace is known


@dataclass(frozen=True)
class TraceParent:
    """A valid `traceparent`: the caller's trace and span, and its sampling decision."""

    trace_id: str  # 32 lower-case hex digits, not all zero
    parent_id: str  # 16 lower-case hex digits, not all zero
    flags: int  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)


@dataclass(frozen=True)
class TraceContext:
    """What the headers say about tracing: the parent (None: start a new trace) and its
    `tracestate` (only with a valid parent: the specification ties one to the other)."""

    parent: TraceParent | None = None
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        """The caller's trace id, or `-`."""
        return self.parent.trace_id if self.parent is not None else NO_TRACE


def _hex(text: str, length: int) -> bool:
    return len(text) == length and _LOWER_HEX.issuperset(text)


def parse_traceparent(value: str) -> TraceParent | None:
    """`version-traceid-parentid-flags` per W3C Trace Context, or None when invalid.

    Version 00 is exactly 55 characters. A later version (the specification lets a reader
    parse what it knows of one) may carry more after a further `-`; `ff` is forbidden. All hex
    is lower case; an all-zero trace id or parent id is invalid.
    """
    value = value.strip(" \t")
    if len(value) < 55 or value[2:3] != "-" or not _hex(value[:2], 2) or value[:2] == "ff":
        return None
    if value[:2] == "00" and len(value) != 55:
        return None
    if len(value) > 55 and value[55] != "-":
        return None
    if value[35:36] != "-" or value[52:53] != "-":
        return None
    trace_id, parent_id, flags = value[3:35], value[36:52], value[53:55]
    if not (_hex(trace_id, 32) and _hex(parent_id, 16) and _hex(flags, 2)):
        return None
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    return TraceParent(trace_id, parent_id, int(flags, 16))


def trace_context_of(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, TraceContext]:
    """The request id (the first `X-Request-Id` if acceptable as sent, else a new one) and the
    trace context, in one pass.

    Two `traceparent` headers make it invalid (which one would be the parent?); several
    `tracestate` headers are one comma-separated list, as HTTP combines them.
    """
    request_id: str | None = None
    traceparents: list[bytes] = []
    states: list[bytes] = []
    for name, value in headers:
        key = name.lower()
        if key == _HEADER_KEY:
            if request_id is None:
                text = value.decode("latin-1")
                request_id = text if is_request_id(text) else new_request_id()
        elif key == _TRACEPARENT:
            traceparents.append(value)
        elif key == _TRACESTATE:
            states.append(value)
    if request_id is None:
        request_id = new_request_id()
    if len(traceparents) != 1:
        return request_id, TraceContext()
    parent = parse_traceparent(traceparents[0].decode("latin-1"))
    if parent is None:
        return request_id, TraceContext()
    state = b",".join(states).decode("latin-1") if states else None
    if state is not None and len(state) > TRACESTATE_MAX_CHARS:
        state = None
    return request_id, TraceContext(parent, state)


def new_request_id() -> str:
    """A fresh id: 32 hex digits (128 random bits, as a UUID4's hex without its object),
    unique enough to grep for across replicas."""
    return os.urandom(16).hex()


def server_timing(queue_ms: float | None, worker_ms: float | None, total_ms: float | None,
                  *, cache: str | None = None, reused_tokens: int | None = None) -> str | None:
    """`queue;dur=0.3, worker;dur=41.2, total;dur=43.0` with what is known, led by
    `cache;desc=hit` (or `coalesced`) for an answer shared from the answer cache, and followed
    by `prefix;desc="reused=1536"` when the worker's prefix cache was looked up for it (the
    prompt tokens it read from the cache; 0: a miss); None if nothing is known."""
    parts = [f"{name};dur={value:.1f}" for name, value in
             (("queue", queue_ms), ("worker", worker_ms), ("total", total_ms))
             if value is not None]
    if cache is not None:
        parts.insert(0, f"cache;desc={cache}")
    if reused_tokens is not None:
        parts.append(f'prefix;desc="reused={reused_tokens}"')
    return ", ".join(parts) or None


def response_headers(request_id: str, timing: str | None) -> list[tuple[str, str]]:
    """The headers every response gets on top of the contract's own."""
    headers = [(HEADER, request_id)]
    if timing is not None:
        headers.append(("Server-Timing", timing))
    return headers

"""Following one request: its id (`X-Request-Id`) and where its time went (`Server-Timing`).

The id is the client's (or the balancer's) `X-Request-Id` when it is printable ASCII without
spaces and at most 128 characters (`clef_protocol.messages.is_trace_id`, the rule the worker
checks too); otherwise, or when absent, a fresh one is made. It is echoed on every response,
written on the access-log line, and sent to the worker as the request frame's `trace_id`, which
puts it on every worker log line about that request.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from clef_protocol.messages import is_trace_id

HEADER = "X-Request-Id"
_HEADER_KEY = HEADER.lower().encode("ascii")


def new_request_id() -> str:
    """A fresh id: 32 hex digits, unique enough to grep for across replicas."""
    return uuid.uuid4().hex


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The first `X-Request-Id` if it is acceptable as sent, else a new id."""
    for name, value in headers:
        if name.lower() == _HEADER_KEY:
            text = value.decode("latin-1")
            return text if is_trace_id(text) else new_request_id()
    return new_request_id()


def server_timing(
    queue_ms: float | None, worker_ms: float | None, total_ms: float | None
) -> str | None:
    """`queue;dur=0.3, worker;dur=41.2, total;dur=43.0` with what is known; None if nothing."""
    parts = [f"{name};dur={value:.1f}" for name, value in
             (("queue", queue_ms), ("worker", worker_ms), ("total", total_ms))
             if value is not None]
    return ", ".join(parts) or None


def response_headers(request_id: str, timing: str | None) -> list[tuple[str, str]]:
    """The headers every response gets on top of the contract's own."""
    headers = [(HEADER, request_id)]
    if timing is not None:
        headers.append(("Server-Timing", timing))
    return headers

"""One request's state as the pipeline's steps fill it in, and the I/O they may use.

Its own module, below `pipeline` and the step modules (`traffic`), so a step module can name
the context without importing the pipeline that runs it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from clef_api.responses import Reply
from clef_api.routes import Route
from clef_dispatch import Outcome
from clef_frontend import logs, otel, tracing
from clef_frontend.auth import NamedKey
from clef_frontend.http1 import RequestHead
from clef_frontend.priority import INTERACTIVE

if TYPE_CHECKING:
    from clef_dispatch import TicketView
    from clef_frontend.answer_cache import Shared


class ClientGone(Exception):
    """The client left before its answer: nothing is sent, the request counts as 499."""


class RequestIO(Protocol):
    """The I/O a step may need, provided by the connection (or by a test)."""

    async def read_body(self, length: int) -> bytes | Reply:
        """The whole body of `length` bytes, or the reply that ends the request (408, 400)."""
        ...

    def skip_body(self) -> None:
        """The request's body will not be read (a bodyless route)."""
        ...

    async def wait_answer(
        self, answer: asyncio.Future[Outcome], on_gone: Callable[[], None]
    ) -> Outcome:
        """`answer`'s outcome; if the client leaves first, call `on_gone` (which ends the wait by
        cancelling `answer`, or lets an answer others share run on) and raise ClientGone."""
        ...

    def client_gone(self) -> bool:
        """Whether the client has already closed its side (asked right before the request's
        frame is written, so a request whose client left is never sent to a worker)."""
        ...


class HealthReply(Protocol):
    def reply(self) -> Reply: ...


@dataclass(slots=True)
class RequestContext:
    """Everything known about one request, filled in step by step.

    `key` is the identity of the API key the request presented (None while no step sets it);
    `route` is None until routed (and stays None for unknown targets and malformed heads).
    """

    head: RequestHead | None
    io: RequestIO
    method: bytes = b"-"
    target: bytes = b"-"
    request_id: str = field(default_factory=tracing.new_request_id)
    route: Route | None = None
    route_label: str = "-"
    key: str | None = None
    api_key: NamedKey | None = None  # the key itself, for its quota (None: keys are off)
    priority: str = INTERACTIVE  # X-Clef-Priority, else the key's class (traffic.py)
    deadline: float | None = None  # X-Clef-Deadline-Ms as time.monotonic() (traffic.py)
    body_length: int | None = None
    body: bytes | None = None
    request: dict[str, Any] | None = None  # the body as validation parsed it
    # Sharing (traffic.share): the request's identity for the answer cache, how its answer
    # comes (`hit`, `coalesced`, `miss`; None with the cache off; a joiner admitted on its own
    # becomes a miss), the cache's decision (`shared`: what the answer cache's one call
    # needs) and when it was made.
    identity: bytes | None = None
    cache: str | None = None
    # Its prefix key (clef_dispatch.prefix_key), taken with the identity when there are
    # several workers: admission prefers the worker whose prefix cache may hold its state.
    prefix_key: bytes | None = None
    # The body's `model` once validated, with fine-tuned variants served (metrics, access log),
    # and the model it asks for: the variant's name, or "" for the base (where it may be sent,
    # what its kept answer records).
    model: str | None = None
    variant: str = ""
    # The fingerprint of the weights that made the answer ("": no answer, or a worker that does
    # not say), for the access log.
    weights: str = ""
    shared: Shared | None = None
    shared_at: float | None = None
    # The dispatcher's read-only view of this request's own ticket (a miss, or the cache off;
    # a joiner admitted on its own too): its outcome and timings.
    ticket: TicketView | None = None
    started: float = field(default_factory=time.monotonic)
    # Traces (otel.py): the W3C trace id for the access line ("-": none known), the server
    # span when tracing is on, and when the awaited answer arrived, a worker's, a kept or a
    # shared one (its spans end there; None: the request ended before it awaited one).
    trace_id: str = tracing.NO_TRACE
    span: otel.RequestSpan | None = None
    answered_at: float | None = None

    @classmethod
    def of(cls, head: RequestHead, io: RequestIO) -> RequestContext:
        """The context of a parsed head, with its request id (the client's, if acceptable)
        and its place in a trace (the caller's `traceparent`, if valid)."""
        request = head.request
        request_id, trace = tracing.trace_context_of(request.headers)
        ctx = cls(head, io, method=request.method, target=request.target,
                  request_id=request_id)
        ctx.trace_id, ctx.span = otel.begin(trace, request.method, request.target, request_id,
                                            ctx.started)
        logs.bind_request(request_id, ctx.trace_id)
        return ctx

    def header(self, name: bytes) -> bytes | None:
        """The first value of a request header (`name` lower-case)."""
        return self.head.header(name) if self.head is not None else None

    @property
    def bytes_in(self) -> int:
        return len(self.body) if self.body is not None else 0

    @property
    def scoring(self) -> bool:
        return self.route is not None and self.route.is_scoring

    @property
    def reused_tokens(self) -> int | None:
        """The prompt tokens the worker's prefix cache gave the forward that answered this
        request; None when it was not looked up (off, no worker reply, a shared answer)."""
        reply = self.ticket.worker_reply if self.ticket is not None else None
        prefix = reply.prefix if reply is not None else None
        return prefix.reused_tokens if prefix is not None else None

    def trace_headers(self) -> list[tuple[str, str]]:
        """`X-Request-Id`, and `Server-Timing` on every answer that went through admission:
        the queue and the worker for this request's own forward (and the prompt tokens its
        worker's prefix cache gave it, `prefix;desc="reused=N"`), `cache;desc=hit` or
        `cache;desc=coalesced` for an answer it shared; `total` on both."""
        if self.answered_at is None:  # refused before its answer was awaited
            return tracing.response_headers(self.request_id, None)
        total_ms = (time.monotonic() - self.started) * 1000.0
        ticket = self.ticket
        if ticket is not None:
            timing = tracing.server_timing(ticket.queue_ms, ticket.worker_ms, total_ms,
                                           reused_tokens=self.reused_tokens)
        else:
            timing = tracing.server_timing(None, None, total_ms, cache=self.cache)
        return tracing.response_headers(self.request_id, timing)


Step = Callable[[RequestContext], Awaitable[Reply | None]]

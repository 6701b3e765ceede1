"""The request pipeline: what happens to one request, as plain async steps over a context.

The connection (connection.py) turns bytes into a `RequestContext` and a `Reply` back into
bytes; everything in between is here, one step per stage of docs/http-contract.md, declared once in
`Pipeline.steps`, in contract order:

    head size -> route -> head decisions (key, model name, /v1/models) -> key name -> quota
    -> class -> deadline -> POST head checks -> body read -> body validation (and the
    request's identity) -> sharing (answer cache) -> admission -> the answer

Each step takes the context and returns a `Reply` that ends the request, or None to go on; a
step may fill in the context for the steps after it (the route, the body length, the body, the
identity, the ticket). The shared-traffic steps are traffic.py's; the pipeline builds them, so
the server and a test rig run the same list. Every scoring request, whether its answer comes
from a worker, from the answer cache or from an identical request in flight, goes through the
same `admit` and `await_answer` steps, and leaves the same traces (`Server-Timing`, metrics, the
access line, spans). The only I/O a step may need, reading the body and waiting for the answer
while watching the client, goes through the `RequestIO` the connection provides (a test passes
its own).

`answer` runs the steps, gives the reply its route's form (the Workers-AI envelope) and counts
its metrics before it is written; the connection sends it, then `log` writes its access line.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from clef_api import responses, workers_ai
from clef_api.checks import RequestRules
from clef_api.responses import Reply
from clef_api.routes import Route, route
from clef_dispatch import Answer, Outcome, Refusal, TicketView, prefix_key
from clef_frontend import gateway, logs, otel
from clef_frontend.answer_cache import MISS, AnswerCache, identity
from clef_frontend.api import ApiSurface
from clef_frontend.auth import NO_KEY
from clef_frontend.config import ServerConfig
from clef_frontend.http1 import RefusedHead
from clef_frontend.metrics import Metrics, route_label
from clef_frontend.request_context import (
    ClientGone,
    HealthReply,
    RequestContext,
    RequestIO,
    Step,
)
from clef_frontend.traffic import TrafficSteps

__all__ = ["ClientGone", "HealthReply", "Pipeline", "RequestContext", "RequestIO", "Step"]

log = logging.getLogger("clef_frontend.pipeline")

# Bodies above this are parsed and validated in a thread, so a large JSON document does not
# stall the event loop (and every other client) for the length of its parse.
INLINE_CHECK_BYTES = 64 * 1024


class Dispatch(Protocol):
    """What the pipeline asks of the workers' side (a `clef_dispatch.Dispatcher`)."""

    @property
    def draining(self) -> bool: ...

    def submit(self, body: bytes, request_id: str = "", *, trace_id: str = "",
               priority: str = ..., deadline: float | None = None,
               gone: Callable[[], bool] = ...,
               affinity: bytes | None = None, model: str = ...) -> TicketView | Refusal: ...

    def abandon(self, ticket: TicketView) -> None: ...


class Pipeline:
    """The steps every request goes through, and the services they consult.

    One per server, shared by every connection: it holds no per-request state.
    """

    def __init__(
        self,
        *,
        config: ServerConfig,
        dispatch: Dispatch,
        health: HealthReply,
        metrics: Metrics,
        api: ApiSurface | None = None,
        cache: AnswerCache | None = None,
    ) -> None:
        self.config = config
        self.dispatch = dispatch
        self.health = health
        self.metrics = metrics
        self.api = api or ApiSurface()
        # The request checks' stages, in the one order clef_api owns (clef-batch runs the same).
        self.rules = RequestRules(config.limits, self.api.catalogue, config.body_limit)
        self.cache = cache if cache is not None else AnswerCache(
            config.answer_cache, config.answer_cache_bytes, config.queue_timeout)
        # With one worker there is no choice to make: no prefix key is taken.
        self.affinity = config.workers.worker_count > 1
        self.traffic = TrafficSteps(self.api.keys, metrics, self.cache,
                                    objective_classes=config.objective_classes)
        traffic = self.traffic
        self.steps: list[Step] = [
            self.check_head_size, self.route, self.decide_from_head,
            traffic.identify, traffic.check_quota, traffic.classify, traffic.set_deadline,
            self.check_post_head, self.read_body, self.validate,
            traffic.share, self.admit, self.await_answer,
        ]

    @property
    def draining(self) -> bool:
        """Every answer says `Connection: close` while the server drains."""
        return self.dispatch.draining

    async def answer(self, ctx: RequestContext) -> Reply | None:
        """Run the steps until one answers; the reply in its route's form, counted. None if
        the client left first (counted as 499)."""
        try:
            reply = await self._run(ctx)
        except ClientGone:
            self.count(ctx, 499)
            return None
        reply = self.finish(ctx, reply)
        self.count(ctx, reply.status)
        return reply

    def refused_head(self, ctx: RequestContext, head: RefusedHead) -> Reply:
        """A head h11 refused (400, 431...): its reply in the target's form, counted."""
        reply = self.api.finish(head.target, head.reply)
        self.count(ctx, reply.status)
        return reply

    async def _run(self, ctx: RequestContext) -> Reply:
        for step in self.steps:
            reply = await step(ctx)
            if reply is not None:
                return reply
        raise RuntimeError("no step answered the request")

    # -- the steps, in contract order -----------------------------------------------------------

    async def check_head_size(self, ctx: RequestContext) -> Reply | None:
        """Row 0: a head over the header limit (h11 enforces it only on incomplete heads)."""
        if ctx.head is not None and ctx.head.size > self.config.header_limit:
            return responses.error(431, "request header block too large", close=True)
        return None

    async def route(self, ctx: RequestContext) -> Reply | None:
        """The route table (404, 405); `/health` and `/metrics` are answered here."""
        found = route(ctx.method, ctx.target)
        ctx.route = found if isinstance(found, Route) else None
        known = isinstance(found, Route) or found.status == 405
        ctx.route_label = route_label(workers_ai.route_path(ctx.target), known=known)
        if isinstance(found, Reply):
            ctx.io.skip_body()
            return found
        if found is Route.HEALTH:
            ctx.io.skip_body()
            return self.health.reply()
        if found is Route.METRICS:
            ctx.io.skip_body()
            return self.metrics.public_reply()
        return None

    async def decide_from_head(self, ctx: RequestContext) -> Reply | None:
        """API key (401), `/v1/models`, then the checks' target stage (Workers-AI model name,
        404): before any body byte."""
        found = ctx.route
        assert found is not None
        decided = self.api.decide_from_head(found, ctx.header(b"authorization"))
        if decided is None and found is Route.WORKERS_AI:
            decided = self.rules.check_target(ctx.target)
        if decided is not None:
            ctx.io.skip_body()
        return decided

    async def check_post_head(self, ctx: RequestContext) -> Reply | None:
        """Rows 1-5, the checks' head stage: the body's length, or the refusal."""
        assert ctx.head is not None
        length = self.rules.check_head(ctx.head.framing, ctx.header(b"content-type"))
        if isinstance(length, Reply):
            return length
        ctx.body_length = length
        return None

    async def read_body(self, ctx: RequestContext) -> Reply | None:
        """Rows 6-7: the whole body, before anything else happens to it."""
        assert ctx.body_length is not None
        body = await ctx.io.read_body(ctx.body_length)
        if isinstance(body, Reply):
            return body
        ctx.body = body
        return None

    async def validate(self, ctx: RequestContext) -> Reply | None:
        """Rows 8-12 and the body's model, the checks' body stage: before admission, so a bad
        request never waits; the request's identity for the answer cache and its prefix key
        (with several workers) are taken from the parsed body here, once."""
        body = ctx.body
        assert body is not None
        key_name = (ctx.key or NO_KEY) if self.cache.enabled else None
        check = functools.partial(_check, self.rules, ctx.target, body, key_name,
                                  affinity=self.affinity)
        checked = await asyncio.to_thread(check) if len(body) > INLINE_CHECK_BYTES else check()
        if isinstance(checked, Reply):
            return checked
        ctx.request, ctx.identity, ctx.prefix_key = checked
        catalogue = self.api.catalogue
        if catalogue.chooses_model:  # the model chosen (checked), for its metrics and workers
            ctx.model = ctx.request.get("model")
            ctx.variant = catalogue.model_of(ctx.model)
        return None

    async def admit(self, ctx: RequestContext) -> Reply | None:
        """Row 14: the dispatcher takes the request, or refuses it (503); a request whose
        deadline passes while it waits gets 504 instead of a worker. A request answered from the
        cache or sharing one in flight has its answer coming already and is not admitted again;
        while the server drains it is refused all the same, as every new request is."""
        shared = ctx.shared
        if shared is not None and shared.admitted_elsewhere:
            if not self.dispatch.draining:
                return None
            self.cache.leave(shared)
            return responses.unavailable("server is draining", self.config.retry_after)
        # A shared request is wanted while any caller of it is, not only while this client is.
        flight = shared.flight if shared is not None else None
        ticket = self._submit(ctx, flight.all_gone if flight is not None else ctx.io.client_gone)
        if isinstance(ticket, Refusal):
            return responses.from_outcome(ticket)
        if shared is not None:
            self.cache.admitted(shared, ticket, self.dispatch.abandon)
        return None

    def _submit(self, ctx: RequestContext, gone: Callable[[], bool]) -> TicketView | Refusal:
        """Hand the request to the dispatcher; its view of the ticket is the request's own
        (`ctx.ticket`: the queue and worker timings, the worker's reply)."""
        assert ctx.body is not None
        ticket = self.dispatch.submit(
            ctx.body, ctx.request_id, trace_id=ctx.trace_id, priority=ctx.priority,
            deadline=ctx.deadline, gone=gone, affinity=ctx.prefix_key, model=ctx.variant)
        if not isinstance(ticket, Refusal):
            ctx.ticket = ticket
        return ticket

    async def await_answer(self, ctx: RequestContext) -> Reply | None:
        """The answer (200, 422, row 13's 500), while the client is watched: a worker's, a kept
        one, or a shared forward's. How a shared answer comes (a joiner's own deadline and
        client, the first request's client leaving, the landing, a joiner admitted on its own
        when the request it shared was not answered) is the answer cache's, in one call."""
        if ctx.shared is None:
            outcome = await self._own_answer(ctx)
        else:
            outcome = await self.cache.answer(
                ctx.shared, ctx.io.wait_answer, functools.partial(self._answer_alone, ctx),
                functools.partial(self._joiner_expired, ctx))
        ctx.answered_at = time.monotonic()
        if isinstance(outcome, Answer):
            ctx.weights = outcome.reply.weights
        return responses.from_outcome(outcome)

    async def _own_answer(self, ctx: RequestContext) -> Outcome:
        """The request's own ticket's outcome; given up if its client leaves."""
        ticket = ctx.ticket
        assert ticket is not None
        return await ctx.io.wait_answer(ticket.outcome,
                                        functools.partial(self.dispatch.abandon, ticket))

    async def _answer_alone(self, ctx: RequestContext) -> Outcome:
        """A joiner whose shared request was not answered (refused, expired, a worker's 500):
        admitted on its own, which makes it a miss, and answered by its own ticket."""
        ctx.cache = MISS
        ticket = self._submit(ctx, ctx.io.client_gone)
        if isinstance(ticket, Refusal):
            return ticket
        return await self._own_answer(ctx)

    def _joiner_expired(self, ctx: RequestContext) -> None:
        """A request sharing another's forward reached its own deadline: 504 for it alone."""
        log.info("request_id=%s class=%s: deadline passed while sharing an identical request's "
                 "forward", ctx.request_id, ctx.priority)
        self.metrics.expired(ctx.priority)

    # -- after the answer ---------------------------------------------------------------------

    def finish(self, ctx: RequestContext, reply: Reply) -> Reply:
        """The reply in its route's form (the Workers-AI envelope on that route)."""
        return self.api.finish(ctx.target if ctx.target != b"-" else None, reply)

    def count(self, ctx: RequestContext, status: int) -> None:
        """The request's metrics, before its answer is written: a client that has its answer
        (and scrapes next) always finds its request counted."""
        ticket = ctx.ticket
        if ctx.cache is not None:  # how its answer came, now that it has (a re-admitted
            self.metrics.answer_cache_lookup(ctx.cache)  # joiner is a miss)
        self.metrics.request_done(
            route=ctx.route_label, status=status, scoring=ctx.scoring,
            duration_s=time.monotonic() - ctx.started,
            queue_ms=ticket.queue_ms if ticket else None,
            worker_ms=ticket.worker_ms if ticket else None,
            worker_reply=ticket.worker_reply if ticket else None,
            key=ctx.key or NO_KEY, priority=ctx.priority,
        )
        if ctx.model is not None:
            self.metrics.model_request(ctx.model, status)

    def log(self, ctx: RequestContext, status: int, bytes_out: int, client: str) -> None:
        """The access-log line, once the request is answered (or abandoned)."""
        ticket = ctx.ticket
        tenant = gateway.tenant_of(ctx.header(gateway.FAIRNESS_HEADER))
        logs.request_line(
            method=ctx.method, target=ctx.target, status=status,
            queue_ms=ticket.queue_ms if ticket else None,
            worker_ms=ticket.worker_ms if ticket else None,
            bytes_in=ctx.bytes_in, bytes_out=bytes_out, client=client,
            request_id=ctx.request_id, batch=_batch_of(ticket), trace_id=ctx.trace_id,
            key=ctx.key or NO_KEY, cache=ctx.cache, tenant=tenant, model=ctx.model,
            weights=responses.short_weights(ctx.weights) if ctx.weights else None,
            reused=ctx.reused_tokens,
        )
        otel.end(ctx.span, status=status, route=ctx.route_label, ticket=ticket,
                 answered_at=ctx.answered_at, cache=ctx.cache, shared_at=ctx.shared_at,
                 tenant=tenant, reused_tokens=ctx.reused_tokens)
        logs.unbind_request()


def _check(rules: RequestRules, target: bytes, body: bytes, key_name: str | None, *,
           affinity: bool) -> Reply | tuple[dict[str, Any], bytes | None, bytes | None]:
    """The checked body (the rules' body stage), its identity (None: no cache) and its prefix
    key (None: one worker), or the refusal; run in a thread for large bodies, so neither the
    parse nor the hashes stall the event loop."""
    checked = rules.check_body(target, body)
    if isinstance(checked, Reply):
        return checked
    return (checked, identity(key_name, checked) if key_name is not None else None,
            prefix_key(checked) if affinity else None)


def _batch_of(ticket: TicketView | None) -> int | None:
    """The worker forward's size for an answered request (None: no answer from a worker)."""
    reply = ticket.worker_reply if ticket is not None else None
    return reply.batch_size if reply is not None and reply.body is not None else None

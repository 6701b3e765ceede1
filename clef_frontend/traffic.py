"""The request pipeline's shared-traffic steps: who is asking, may they, how urgently, and
has this exact request already been answered or is it being answered now.

Inserted into `pipeline.Pipeline.steps` by `install`, each at its place in contract order:

    ... decide_from_head -> identify (key name, quota 429, X-Clef-Priority, X-Clef-Deadline-Ms)
    ... validate -> share (answer cache hit, or join an identical request in flight) -> admit

`identify` runs before any body byte is read, so a refused request costs no upload. `share`
admits a first-of-its-kind request itself and waits on it as the pipeline's `await_worker`
would; with `--answer-cache 0` it steps aside and the pipeline admits as before.
"""

from __future__ import annotations

from clef_frontend import deadlines, priority
from clef_frontend.answer_cache import COALESCED, HIT, MISS, AnswerCache, Flight, request_key
from clef_frontend.auth import NO_KEY, ApiKeys
from clef_frontend.metrics import Metrics
from clef_frontend.pipeline import INLINE_CHECK_BYTES, Pipeline, RequestContext
from clef_frontend.quotas import Quotas
from clef_frontend.responses import Reply


class TrafficSteps:
    """The steps, and what they consult: the keys, the quotas and the answer cache."""

    def __init__(self, pipeline: Pipeline, keys: ApiKeys, metrics: Metrics,
                 cache: AnswerCache, quotas: Quotas | None = None) -> None:
        self._pipeline = pipeline
        self._keys = keys
        self._metrics = metrics
        self.cache = cache
        self.quotas = quotas or Quotas()

    def install(self) -> None:
        """Put the steps into the pipeline, each right after the step it follows."""
        steps = self._pipeline.steps
        steps.insert(steps.index(self._pipeline.decide_from_head) + 1, self.identify)
        steps.insert(steps.index(self._pipeline.validate) + 1, self.share)

    async def identify(self, ctx: RequestContext) -> Reply | None:
        """The key's name and quota (429), then the request's class and deadline (400 if
        their headers are malformed); refusals come before the body is read."""
        key = self._keys.identify(ctx.header(b"authorization")) if self._keys.enabled else None
        ctx.key = key.name if key is not None else NO_KEY
        refusal: Reply | None = None
        if key is not None:
            refusal = self.quotas.check(key)
            if refusal is not None:
                self._metrics.quota_refused(key.name)
        if refusal is None:
            default = key.priority if key is not None else priority.INTERACTIVE
            default = priority.from_objective(ctx.header(priority.OBJECTIVE_HEADER),
                                              self._pipeline.config.objective_classes, default)
            chosen = priority.from_header(ctx.header(priority.HEADER), default)
            deadline = deadlines.from_header(ctx.header(deadlines.HEADER), ctx.started)
            if isinstance(chosen, Reply):
                refusal = chosen
            elif isinstance(deadline, Reply):
                refusal = deadline
            else:
                ctx.priority, ctx.deadline = chosen, deadline
        if refusal is not None:
            ctx.io.skip_body()
        return refusal

    async def share(self, ctx: RequestContext) -> Reply | None:
        """Answer from the cache (hit), wait on an identical request in flight (coalesced), or
        admit this one as the first of its kind (miss) and wait on it."""
        if not self.cache.enabled:
            return None
        assert ctx.body is not None
        # Re-encoding waits on the event loop, so only bodies validated inline are canonical.
        inline = len(ctx.body) <= INLINE_CHECK_BYTES
        key = request_key(ctx.key or NO_KEY, ctx.body, ctx.request if inline else None)
        found = self.cache.lookup(key)
        if isinstance(found, Reply):
            self._metrics.answer_cache_lookup(HIT)
            return found
        if isinstance(found, Flight):
            self._metrics.answer_cache_lookup(COALESCED)
            return await self._wait(ctx, found)
        self._metrics.answer_cache_lookup(MISS)
        flight = Flight()
        # The request is wanted while any caller of it is: not only while this client is.
        refused = await self._pipeline.admit(ctx, gone=flight.all_gone)
        if refused is not None:
            return refused
        ticket = ctx.ticket
        assert ticket is not None
        admission = self._pipeline.admission
        flight.on_all_gone = lambda: admission.abandon(ticket)
        return await self._wait(ctx, self.cache.start(key, flight, ticket.outcome))

    async def _wait(self, ctx: RequestContext, flight: Flight) -> Reply:
        mine = flight.join()
        return await ctx.io.wait_answer(mine, lambda: flight.leave(mine))

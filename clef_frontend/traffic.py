"""The request pipeline's shared-traffic steps: who is asking, may they, how urgently, and
has this exact request already been answered or is it being answered now.

Plain steps of `pipeline.Pipeline.steps`, which declares them in contract order with the rest:

    ... decide_from_head -> identify (key name) -> check_quota (429) -> classify
        (X-Clef-Priority) -> set_deadline (X-Clef-Deadline-Ms) -> ... validate -> share -> admit
        -> await_answer

`identify`, `check_quota`, `classify` and `set_deadline` run before any body byte is read, so a
refused request costs no upload. `share` only decides how the request will get its answer: from
the cache (hit), by joining an identical request in flight (coalesced), or by being admitted as
the first of its kind (miss); the pipeline's own `admit` and `await_answer` then run for all
three, so every scoring request leaves the same traces (the rules of sharing are
answer_cache.py's). With `--answer-cache 0` nothing is shared: every request
is admitted on its own and `cache` stays unset.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from clef_api.responses import Reply
from clef_frontend import deadlines, priority
from clef_frontend.answer_cache import AnswerCache
from clef_frontend.auth import NO_KEY, ApiKeys
from clef_frontend.metrics import Metrics
from clef_frontend.quotas import Quotas

if TYPE_CHECKING:
    from clef_frontend.request_context import RequestContext


class TrafficSteps:
    """The steps, and what they consult: the keys, the quotas and the answer cache."""

    def __init__(self, keys: ApiKeys, metrics: Metrics, cache: AnswerCache,
                 quotas: Quotas | None = None,
                 objective_classes: tuple[tuple[str, str], ...] = ()) -> None:
        self._keys = keys
        self._objective_classes = objective_classes
        self._metrics = metrics
        self.cache = cache
        self.quotas = quotas or Quotas()

    async def identify(self, ctx: RequestContext) -> Reply | None:
        """The key's name (`-` without keys), and its class as the request's default."""
        key = self._keys.identify(ctx.header(b"authorization")) if self._keys.enabled else None
        ctx.api_key = key
        ctx.key = key.name if key is not None else NO_KEY
        if key is not None:
            ctx.priority = key.priority  # unless X-Clef-Priority says otherwise
        return None

    async def check_quota(self, ctx: RequestContext) -> Reply | None:
        """The key's quota: 429 with Retry-After over its rate, before the body is read."""
        key = ctx.api_key
        if key is None:
            return None
        refusal = self.quotas.check(key)
        if refusal is not None:
            self._metrics.quota_refused(key.name)
            ctx.io.skip_body()
        return refusal

    async def classify(self, ctx: RequestContext) -> Reply | None:
        """The request's class: `X-Clef-Priority`, else the class its gateway objective maps to
        (`--objective-class`), else its key's (400 if `X-Clef-Priority` is malformed)."""
        default = priority.from_objective(ctx.header(priority.OBJECTIVE_HEADER),
                                          self._objective_classes, ctx.priority)
        chosen = priority.from_header(ctx.header(priority.HEADER), default)
        if isinstance(chosen, Reply):
            ctx.io.skip_body()
            return chosen
        ctx.priority = chosen
        return None

    async def set_deadline(self, ctx: RequestContext) -> Reply | None:
        """`X-Clef-Deadline-Ms` from the end of the head (400 if malformed)."""
        deadline = deadlines.from_header(ctx.header(deadlines.HEADER), ctx.started)
        if isinstance(deadline, Reply):
            ctx.io.skip_body()
            return deadline
        ctx.deadline = deadline
        return None

    async def share(self, ctx: RequestContext) -> Reply | None:
        """Decide how the answer comes (answer_cache.AnswerCache.share): a kept answer (hit),
        an identical request in flight (coalesced), or this request admitted as the first of
        its kind (miss)."""
        if not self.cache.enabled:
            return None
        assert ctx.identity is not None  # resolved once, by validation
        shared = self.cache.share(ctx.identity, priority=ctx.priority, deadline=ctx.deadline,
                                  client_gone=ctx.io.client_gone)
        ctx.cache = shared.how  # counted once the answer has come (`Pipeline.count`)
        ctx.shared = shared
        ctx.shared_at = time.monotonic()
        return None

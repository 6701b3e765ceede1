"""The start-up self-check's `prefix` probe: a request answered through a cached prefix, beside
an uncached request in the same group, compared with the plain eager answers.

Why: the prefixed forward (clef_worker.model.prefix_forward) continues every layer from cached
states: a wrong position offset, a conv tail off by one or a kernel that ignores its initial
state would not raise, it would serve wrong probabilities to every client whose state repeats.
On a GPU that code path has its own kernels (fla's varlen rule from initial states), so like the
rest of the serving path it is checked on the device before `ready`.

The probe (`probe_requests`): one state long enough for two blocks and a partial one; request
`warm` asks one schema about it (its forward stores the blocks), then `cached` asks another
schema about the same state (it must reuse the stored prefix) in one group with `fresh`, a
request with a state of its own (uncached). `cached` and `fresh` are compared with the plain
eager forward of each alone (clef_worker.self_check's comparison, bounds and per-token hidden
state difference: the cached tokens' hidden states are compared too). The probe's blocks are
dropped either way: no client asked for them.

It is one of the self-check's probes (clef_worker.check_probes), not a layout probe: it runs
once, after the layout has been checked, on the path the worker will serve with. So the modes
apply to it as to the rest: on a mismatch, or when `cached` reused nothing, `on` turns the cache
off for this worker (`turn_cache_off`: `PrefixCache.disable`, an ERROR, `ready` says
`prefix_cache.enabled` false with the reason), `strict` refuses to start, `report` records and
keeps the cache on (a benchmark measures the path it asked for). And its verdict is kept with the
rest (clef_worker.verdict_store): a restart on the same weights, code and cache settings skips it
too; a verdict whose remedy turned the cache off is never kept, so the next start checks again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import Encoding
from clef_worker.prefix_cache import CacheKey, PrefixCache
from clef_worker.self_check import Context, ProbeResult, compare
from clef_worker.warmup import candidates

if TYPE_CHECKING:
    from clef_worker.warmup import WarmTarget

log = logging.getLogger("clef_worker.self_check")

PROBE_NAME = "prefix"
# The probe's shared state: two full blocks and part of a third, so the cached request walks a
# chain and ends on a partial block (at most this many tokens: CUDA's long blocks are cut to
# a chain of two points, the block end and the state end, which checks the same code).
SHARED_BLOCKS = 2.5
SHARED_MAX_TOKENS = 2600
FRESH_TOKENS = 96  # the uncached neighbour's state


def probe_requests(target: WarmTarget) -> tuple[Encoding, Encoding, Encoding] | None:
    """(warm, cached, fresh): see the module docs; None when the limits leave no room."""
    cache = target.runner.prefix_cache
    assert cache is not None
    schemas = [request for request in candidates(target.limits) if _valid(target, request)]
    if len(schemas) < 2:
        return None
    shared = min(int(cache.block_tokens * SHARED_BLOCKS), SHARED_MAX_TOKENS)
    try:
        warm = _encoding(target, schemas[1], "shared", shared)
        cached = _encoding(target, schemas[0], "shared", shared)
        fresh = _encoding(target, schemas[1], "fresh", FRESH_TOKENS)
    except RequestInvalid:
        return None  # --max-length too short for a cached block: nothing to check
    return warm, cached, fresh


def _valid(target: WarmTarget, request: dict[str, Any]) -> bool:
    try:
        validate_request(request, target.limits)
    except RequestInvalid:
        return False
    return True


def _encoding(target: WarmTarget, schema: dict[str, Any], name: str,
              tokens: int) -> Encoding:
    """The schema asked about a state of its own (`name`) cut to exactly `tokens` tokens, so two
    schemas asked about the same name share those state tokens."""
    state = "".join(f"{name} event {k}: order #{k * 31} shipped to depot {k % 7}. "
                    for k in range(tokens // 4 + 8))  # every sentence is several tokens
    fixed = target.encoder.encode({**schema, "state": "x"}, target.limits.max_length)
    budget = fixed.length - fixed.state_tokens + tokens
    if budget > target.limits.max_length:
        raise RequestInvalid(f"the probe needs {budget} tokens")
    return target.encoder.encode({**schema, "state": state}, budget)


def _key(target: WarmTarget, encoding: Encoding) -> CacheKey:
    return CacheKey(target.cache_root(0), len(target.encoder.prefix_ids) + encoding.state_tokens)


def probe_prefix(context: Context) -> ProbeResult | None:
    """The `prefix` probe of the start-up self-check (module docs). Its result disagrees when
    an answer differs from the eager one beyond the bound, or when `cached` reused nothing (a
    cache that never hits checks nothing). None when there is no cache, it is off, or the
    limits leave no room for the probe."""
    target = context.target
    cache: PrefixCache | None = target.runner.prefix_cache
    if cache is None or not cache.enabled:
        return None
    requests = probe_requests(target)
    if requests is None:
        log.warning("prefix-cache check skipped: --max-length leaves no room for a cached block")
        return None
    warm, cached, fresh = requests
    references = [context.reference(encoding) for encoding in (cached, fresh)]
    runner = target.runner
    try:
        runner.run([warm], cache_keys=[_key(target, warm)])
        output = runner.run([cached, fresh], keep_hidden=True,
                            cache_keys=[_key(target, cached), _key(target, fresh)])
    except Exception as exc:
        log.error("prefix-cache check: the prefixed forward raised", exc_info=True)
        return ProbeResult(PROBE_NAME, 2, 1.0, error=f"{type(exc).__name__}: {exc}",
                           extra={"reused_tokens": 0})
    finally:
        cache.clear()  # the probe's blocks: no client asked for them
    comparison = compare(output.rows, [answer.row for answer in references], [cached, fresh],
                         context.bound)
    reused = output.rows[0].reused_tokens
    hidden = Context.hidden_diff(output.hidden, references)
    return ProbeResult(PROBE_NAME, 2, comparison.max_abs_diff, comparison.argmax_mismatches,
                       hidden, [comparison.max_abs_diff],
                       "" if reused else "the cached request reused no cached tokens",
                       comparison.worst_tokens, extra={"reused_tokens": reused})


def turn_cache_off(target: WarmTarget, result: ProbeResult) -> str:
    """The `prefix` probe's remedy under `--self-check on`: the cache off for this worker, with
    the reason in `ready` (and so `/health`); serving goes on uncached."""
    cache = getattr(target.runner, "prefix_cache", None)
    reason = (f"self-check: the prefixed probe differs from the eager answers by "
              f"{result.max_abs_diff:.3g}, {result.argmax_mismatches} argmax mismatches"
              f"{', ' + result.error if result.error else ''}")
    if cache is not None:
        cache.disable(reason)
    return f"prefix cache off for this worker: {reason}"

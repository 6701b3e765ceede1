"""The start-up check of the prefix cache: a probe answered through a cached prefix, beside an
uncached request in the same group, compared with the plain eager answers.

Why: the prefixed forward (clef_worker.model.prefix_forward) continues every layer from cached
states: a wrong position offset, a conv tail off by one or a kernel that ignores its initial
state would not raise, it would serve wrong probabilities to every client whose state repeats.
On a GPU that code path has its own kernels (fla's varlen rule from initial states), so like the
rest of the serving path it is checked on the device before `ready`.

The probe (`probe_requests`): one state long enough for two blocks and a partial one; request
`warm` asks one schema about it (its forward stores the blocks), then `cached` asks another
schema about the same state (it must reuse the stored prefix) in one group with `fresh`, a
request with a state of its own (uncached). `cached` and `fresh` are compared with the plain
eager forward of each alone (clef_worker.self_check's comparison and bounds). On a mismatch, or
when `cached` reused nothing, the cache is turned off for this worker (`PrefixCache.disable`),
logged as an ERROR, and `ready` says so (`prefix_cache.enabled` false with the reason). The
probe's blocks are dropped either way: no client asked for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.validation import validate_request
from clef_worker.errors import StartupError
from clef_worker.model.backbone import DTYPE_NAMES
from clef_worker.model.encoding import Encoding
from clef_worker.prefix_cache import CacheKey, PrefixCache
from clef_worker.self_check import BOUNDS, Comparison, compare
from clef_worker.variant_probe import reference_runner
from clef_worker.warmup import candidates

if TYPE_CHECKING:
    from clef_worker.native import NativeExecutor

log = logging.getLogger("clef_worker.self_check")

# The probe's shared state: two full blocks and part of a third, so the cached request walks a
# chain and ends on a partial block (at most this many tokens: CUDA's long blocks are cut to
# a chain of two points, the block end and the state end, which checks the same code).
SHARED_BLOCKS = 2.5
SHARED_MAX_TOKENS = 2600
FRESH_TOKENS = 96  # the uncached neighbour's state


def probe_requests(target: NativeExecutor) -> tuple[Encoding, Encoding, Encoding] | None:
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


def _valid(target: NativeExecutor, request: dict[str, Any]) -> bool:
    try:
        validate_request(request, target.limits)
    except RequestInvalid:
        return False
    return True


def _encoding(target: NativeExecutor, schema: dict[str, Any], name: str,
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


def _key(target: NativeExecutor, encoding: Encoding) -> CacheKey:
    return CacheKey(target.cache_root(0), len(target.encoder.prefix_ids) + encoding.state_tokens)


def check_prefix_cache(target: NativeExecutor, strict: bool = False,
                       report: bool = False) -> Comparison | None:
    """Run the probe (module docs); turn the cache off on a mismatch (`strict`, as
    `--self-check strict`: refuse to start instead; `report`, as `--self-check report`: log the
    mismatch and keep the cache on, so a benchmark measures the path it asked for). None when
    there is no cache, it is off, or the limits leave no room for the probe."""
    cache: PrefixCache | None = target.runner.prefix_cache
    if cache is None or not cache.enabled:
        return None
    requests = probe_requests(target)
    if requests is None:
        log.warning("prefix-cache check skipped: --max-length leaves no room for a cached block")
        return None
    warm, cached, fresh = requests
    runner = target.runner
    dtype = DTYPE_NAMES[target.backbone.dtype]
    bound = BOUNDS.get(dtype, BOUNDS["bfloat16"])
    with reference_runner(runner) as plain:
        reference = [plain.run([encoding]).rows[0] for encoding in (cached, fresh)]
    try:
        runner.run([warm], cache_keys=[_key(target, warm)])
        served = runner.run([cached, fresh],
                            cache_keys=[_key(target, cached), _key(target, fresh)]).rows
        comparison = compare(served, reference, [cached, fresh], bound)
        reused = served[0].reused_tokens
    except Exception as exc:
        log.error("prefix-cache check: the prefixed forward raised", exc_info=True)
        comparison, reused = Comparison(1.0, 0, error=f"{type(exc).__name__}: {exc}"), 0
    finally:
        cache.clear()
    if reused and comparison.agrees(bound):
        log.info("prefix-cache check passed: %d cached tokens reused beside an uncached request, "
                 "max |dp| %.3g within %g", reused, comparison.max_abs_diff, bound)
        return comparison
    if reused or comparison.error:
        reason = (f"self-check: the prefixed probe differs from the eager answers by "
                  f"{comparison.max_abs_diff:.3g} (bound {bound:g}), "
                  f"{comparison.argmax_mismatches} argmax mismatches"
                  f"{', ' + comparison.error if comparison.error else ''}")
    else:
        reason = "self-check: the prefixed probe reused no cached tokens"
    if strict:
        raise StartupError(f"prefix cache check failed (--self-check strict): {reason}")
    if report:
        log.error("prefix cache kept on (--self-check report): %s", reason)
        return comparison
    log.error("prefix cache off for this worker: %s", reason)
    cache.disable(reason)
    return comparison

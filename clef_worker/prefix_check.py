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
request with a state of its own (uncached). With a vision tower, the same again alone with a
picture before the state (`media_requests`: media requests run alone; the prefixed forward's
media branch, the tower's embeddings and 3D rotary positions, and the offset a suffix continues
from). `cached`, `fresh` and the pictured `cached` are compared with the plain
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
import math
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import decode_media
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import Encoding
from clef_worker.prefix_cache import CacheKey, PrefixCache
from clef_worker.self_check import Answer, Context, ProbeResult, compare
from clef_worker.self_check_reference import reference_answer
from clef_worker.warmup import candidates, with_image

if TYPE_CHECKING:
    from clef_worker.media.vision import PreparedMedia
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


def _encoding(target: WarmTarget, schema: dict[str, Any], name: str, tokens: int,
              media: PreparedMedia | None = None) -> Encoding:
    """The schema asked about a state of its own (`name`) cut to exactly `tokens` tokens, so two
    schemas asked about the same name share those state tokens (after `media`'s, if any)."""
    state = "".join(f"{name} event {k}: order #{k * 31} shipped to depot {k % 7}. "
                    for k in range(tokens // 4 + 8))  # every sentence is several tokens
    media_ids = media.token_ids if media is not None else ()
    fixed = target.encoder.encode({**schema, "state": "x"}, target.limits.max_length, media_ids)
    budget = fixed.length - fixed.state_tokens + tokens
    if budget > target.limits.max_length:
        raise RequestInvalid(f"the probe needs {budget} tokens")
    return target.encoder.encode({**schema, "state": state}, budget, media_ids)


def _key(target: WarmTarget, encoding: Encoding, media: PreparedMedia | None = None) -> CacheKey:
    """The key the serve loop gives such a request on the base model."""
    key = target.prefix_key(encoding, media)
    assert key is not None  # the probe's picture is prepared with its digest
    return key


def media_requests(target: WarmTarget) -> tuple[PreparedMedia, Encoding, Encoding] | None:
    """(picture, warm, cached) about one picture and one state, for a worker with a vision
    tower: the prefixed forward's media branch (the tower's embeddings, 3D rotary positions, the
    offset a suffix continues from); None without a tower or room."""
    cache = target.runner.prefix_cache
    vision = target.vision
    if cache is None or vision is None:
        return None
    schemas = [request for request in candidates(target.limits)
               if _valid(target, with_image(request))]
    if len(schemas) < 2:
        return None
    try:
        picture = vision.prepare(decode_media(with_image(schemas[0]), target.limits))
        shared = min(cache.block_tokens + cache.block_tokens // 2, SHARED_MAX_TOKENS)
        warm = _encoding(target, schemas[1], "pictured", shared, picture)
        cached = _encoding(target, schemas[0], "pictured", shared, picture)
    except RequestInvalid:
        return None
    return picture, warm, cached


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
    pictured = media_requests(target)
    references = [context.reference(encoding) for encoding in (cached, fresh)]
    if pictured is not None:
        references.append(_media_reference(target, pictured[0], pictured[2]))
    runner = target.runner
    try:
        runner.run([warm], cache_keys=[_key(target, warm)])
        output = runner.run([cached, fresh], keep_hidden=True,
                            cache_keys=[_key(target, cached), _key(target, fresh)])
        rows, hidden = list(output.rows), Context.hidden_diff(output.hidden, references[:2])
        if pictured is not None:  # a media request runs alone, as the serve loop runs it
            picture, warm_media, cached_media = pictured
            runner.run([warm_media], [picture], cache_keys=[_key(target, warm_media, picture)])
            media_output = runner.run([cached_media], [picture], keep_hidden=True,
                                      cache_keys=[_key(target, cached_media, picture)])
            rows += media_output.rows
            hidden = max(hidden, Context.hidden_diff(media_output.hidden, references[2:]),
                         key=lambda value: math.inf if math.isnan(value) else value)
    except Exception as exc:
        log.error("prefix-cache check: the prefixed forward raised", exc_info=True)
        return ProbeResult(PROBE_NAME, len(references), 1.0,
                           error=f"{type(exc).__name__}: {exc}", extra={"reused_tokens": 0})
    finally:
        cache.clear()  # the probe's blocks: no client asked for them
    encodings = [cached, fresh, *([pictured[2]] if pictured is not None else [])]
    comparison = compare(rows, [answer.row for answer in references], encodings, context.bound)
    reused = [rows[0].reused_tokens, *([rows[2].reused_tokens] if pictured is not None else [])]
    return ProbeResult(PROBE_NAME, len(rows), comparison.max_abs_diff,
                       comparison.argmax_mismatches, hidden, [comparison.max_abs_diff],
                       "" if all(reused) else "a cached request reused no cached tokens",
                       comparison.worst_tokens,
                       extra={"reused_tokens": reused[0],
                              "media_reused_tokens": reused[1] if pictured is not None else None})


def _media_reference(target: WarmTarget, picture: PreparedMedia, encoding: Encoding) -> Answer:
    """A media request through the plain vision path (no cache keys, no graphs)."""
    return Answer(*reference_answer(target.runner, encoding, media=picture))


def turn_cache_off(target: WarmTarget, result: ProbeResult) -> str:
    """The `prefix` probe's remedy under `--self-check on`: the cache off for this worker, with
    the reason in `ready` (and so `/health`); serving goes on uncached."""
    cache = target.runner.prefix_cache
    reason = (f"self-check: the prefixed probe differs from the eager answers by "
              f"{result.max_abs_diff:.3g}, {result.argmax_mismatches} argmax mismatches"
              f"{', ' + result.error if result.error else ''}")
    if cache is not None:
        cache.disable(reason)
    return f"prefix cache off for this worker: {reason}"

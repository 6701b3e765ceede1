"""The start-up self-check's `prefix` probe: a request answered through a cached prefix, beside
an uncached request in the same group, compared with the plain eager answers.

Why: the prefixed forward (clef_worker.model.prefix_forward) continues every layer from cached
states: a wrong position offset, a conv tail off by one or a kernel that ignores its initial
state would not raise, it would serve wrong probabilities to every client whose state repeats.
On a GPU that code path has its own kernels (fla's varlen rule from initial states), so like the
rest of the serving path it is checked on the device before `ready`.

The probe (`probe_requests`): one state long enough for two blocks and a partial one (cut to
the room `--max-length` leaves beside the schemas, `shared_tokens`, so the cached path is
checked under any limit that lets the cache store a block at all; under a limit too short even
for that, `no_room` turns the cache off with the reason in `ready`, rather than serve hits
through a path nobody checked); request
`warm` asks one schema about it (its forward stores the blocks), then `cached` asks another
schema about the same state (it must reuse the stored prefix) in one group with `fresh`, a
request with a state of its own (uncached). With a vision tower, the same again alone with a
picture before the state (`media_requests`: media requests run alone; the prefixed forward's
media branch, the tower's embeddings and 3D rotary positions, and the offset a suffix continues
from). `cached`, `fresh` and the pictured `cached` are compared with the plain
eager forward of each alone (clef_worker.starting.self_check's comparison, bounds and per-token
hidden state difference: the cached tokens' hidden states are compared too). The probe's blocks are
dropped either way: no client asked for them.

It is one of the self-check's probes (clef_worker.starting.check_probes), not a layout probe: it
runs once, after the layout has been checked, on the path the worker will serve with. So the modes
apply to it as to the rest: on a mismatch, or when `cached` reused nothing, `on` turns the cache
off for this worker (`turn_cache_off`: `PrefixCache.disable`, an ERROR, `ready` says
`prefix_cache.enabled` false with the reason), `strict` refuses to start, `report` records and
keeps the cache on (a benchmark measures the path it asked for). And its verdict is kept with the
rest (clef_worker.starting.verdict_store): a restart on the same weights, code and cache settings
skips it too; a verdict whose remedy turned the cache off is never kept, so the next start checks
again.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import decode_media
from clef_protocol.messages import PREFIX_CACHE_UNCHECKED
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import Encoding
from clef_worker.serving.prefix.cache import (
    END_MARGIN,
    MIN_STATE_TOKENS,
    POINT_ALIGN,
    CacheKey,
    PrefixCache,
)
from clef_worker.starting.self_check import Answer, Context, ProbeResult, compare
from clef_worker.starting.self_check_reference import reference_answer
from clef_worker.starting.warm_requests import candidates, with_image

if TYPE_CHECKING:
    from clef_worker.media.vision import PreparedMedia
    from clef_worker.starting.warm_requests import WarmTarget

log = logging.getLogger("clef_worker.starting.self_check")

PROBE_NAME = "prefix"
# The probe's shared state: two full blocks and part of a third, so the cached request walks a
# chain and ends on a partial block (at most this many tokens: CUDA's long blocks are cut to
# a chain of two points, the block end and the state end, which checks the same code).
SHARED_BLOCKS = 2.5
SHARED_MAX_TOKENS = 2600
FRESH_TOKENS = 96  # the uncached neighbour's state
# The shortest shared state that still leaves the cached request something to reuse: the cache
# stores nothing under MIN_STATE_TOKENS, and its last point sits END_MARGIN tokens before the
# state's end, rounded down to POINT_ALIGN. Under `--max-length` the shared state is cut to the
# room the limit leaves (`shared_tokens`), never below this.
MIN_SHARED_TOKENS = MIN_STATE_TOKENS + END_MARGIN + POINT_ALIGN


def shared_tokens(target: WarmTarget, schemas: list[dict[str, Any]], wanted: int,
                  media: PreparedMedia | None = None) -> int | None:
    """The shared state's tokens: `wanted`, cut to what `--max-length` leaves beside the
    schemas' own tokens (and the picture's); None when that is under MIN_SHARED_TOKENS (no
    cached block could then be checked)."""
    try:
        room = min(target.limits.max_length - _fixed_tokens(target, schema, media)
                   for schema in schemas)
    except RequestInvalid:
        return None  # a schema alone exceeds the limit
    tokens = min(wanted, room)
    return tokens if tokens >= MIN_SHARED_TOKENS else None


def _fixed_tokens(target: WarmTarget, schema: dict[str, Any],
                  media: PreparedMedia | None = None) -> int:
    """The schema's tokens besides its state (and the picture's), as `_encoding` counts them."""
    media_ids = media.token_ids if media is not None else ()
    fixed = target.encoder.encode({**schema, "state": "x"}, target.limits.max_length, media_ids)
    return fixed.length - fixed.state_tokens


def probe_requests(target: WarmTarget) -> tuple[Encoding, Encoding, Encoding] | None:
    """(warm, cached, fresh): see the module docs; None when the limits leave no room."""
    cache = target.runner.prefix_cache
    assert cache is not None
    schemas = [request for request in candidates(target.limits) if _valid(target, request)]
    wanted = min(int(cache.block_tokens * SHARED_BLOCKS), SHARED_MAX_TOKENS)
    chosen = _pair(target, schemas, wanted)
    if chosen is None:
        return None
    (rich, bare), shared = chosen
    try:
        warm = _encoding(target, bare, "shared", shared)
        cached = _encoding(target, rich, "shared", shared)
        fresh = _encoding(target, bare, "fresh", FRESH_TOKENS)
    except RequestInvalid:
        return None  # --max-length too short for a cached block: nothing to check
    return warm, cached, fresh


def _pair(target: WarmTarget, schemas: list[dict[str, Any]], wanted: int,
          media: PreparedMedia | None = None
          ) -> tuple[tuple[dict[str, Any], dict[str, Any]], int] | None:
    """The richest two consecutive schemas (richest first) whose own tokens leave room for a
    shared state of at least MIN_SHARED_TOKENS, and that state's tokens; None when no pair
    does."""
    for rich, bare in itertools.pairwise(schemas):
        shared = shared_tokens(target, [rich, bare], wanted, media)
        if shared is not None:
            return (rich, bare), shared
    return None


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
    budget = _fixed_tokens(target, schema, media) + tokens
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
        chosen = _pair(target, schemas, min(cache.block_tokens + cache.block_tokens // 2,
                                            SHARED_MAX_TOKENS), picture)
        if chosen is None:
            return None
        (rich, bare), shared = chosen
        warm = _encoding(target, bare, "pictured", shared, picture)
        cached = _encoding(target, rich, "pictured", shared, picture)
    except RequestInvalid:
        return None
    return picture, warm, cached


def probe_prefix(context: Context) -> ProbeResult | None:
    """The `prefix` probe of the start-up self-check (module docs). Its result disagrees when
    an answer differs from the eager one beyond the bound, or when `cached` reused nothing (a
    cache that never hits checks nothing). None when there is no cache or it is off; where the
    limits leave no room for a cached block, the cache goes off (`no_room`)."""
    target = context.target
    cache: PrefixCache | None = target.runner.prefix_cache
    if cache is None or not cache.enabled:
        return None
    requests = probe_requests(target)
    if requests is None:
        return no_room(target)
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


def no_room(target: WarmTarget) -> ProbeResult:
    """The cached path cannot be checked under these limits (`--max-length` leaves under
    MIN_SHARED_TOKENS of state beside the probe's schemas): the cache goes off for this worker,
    whatever the mode, rather than serve hits through a path nobody checked. Recorded as the
    probe's `remedy`, so the verdict is not kept and the next start decides again."""
    cache = target.runner.prefix_cache
    assert cache is not None
    reason = (f"{PREFIX_CACHE_UNCHECKED}: --max-length {target.limits.max_length} leaves under "
              f"{MIN_SHARED_TOKENS} state tokens for the start-up probe's cached block")
    cache.disable(reason)
    log.warning("%s; the prefix cache is off for this worker", reason)
    return ProbeResult(PROBE_NAME, 0, 0.0, extra={
        "reused_tokens": 0, "media_reused_tokens": None,
        "remedy": f"prefix cache off for this worker: {reason}"})


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

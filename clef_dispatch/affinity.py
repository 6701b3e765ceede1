"""Prefix affinity: requests that share a long state go to the same worker, within a load
margin; everything else is spread by load.

Why: each worker keeps its own prefix cache (the model states of the prompts it has read,
clef_worker's prefix cache), so an agent's next turn, or another question set about the same
document, is cheap only on the worker that read the state before. Spread round robin over W
workers, a state's requests would find their prefix cached one time in W, and every worker
would spend its cache on the same states. But only a long state is worth keeping: the worker
neither stores nor looks up a state span under `MIN_STATE_TOKENS` (256) tokens, whose prefill
is cheap to redo, so a short state gains nothing from its worker, and routing it there would
only pile unrelated short requests onto one worker (keyed by their first power-of-two bytes,
they all start alike).

The front does not tokenize (the tokenizer is the worker's), so the key is taken from the
leading bytes of the request, as prefix-aware routers do: the model name (a fine-tuned variant
changes every layer, so it never shares states with the base), the media (they sit before the
state in the prompt; a digest of their text, sampled at both ends of each entry so a large
image costs no full hash on the event loop) and the first `AFFINITY_BYTES` of the state as the
worker renders it (text as is, any other JSON value as compact sorted JSON); a state shorter
than that is keyed by its first power-of-two bytes, so a short state that grows keeps its key
until its length doubles (an agent's early turns stay together) rather than changing it at
every turn. A request gets a key only when its state could be one the worker's prefix cache
keeps (`KEYED_STATE_BYTES`: a token is at least a byte, so a state of fewer bytes than
`MIN_STATE_TOKENS` is surely too short) or it carries media (pictures are hundreds of tokens
and a vision-tower run, which the cache saves). The key is a hint: two states that share their
leading bytes but not more are sent to the same worker and simply miss its cache, and the load
margin below bounds what such a collision (templated states) costs.

The rule, applied after admission's other filters: among the ready workers that report a prefix
cache turned on (their `ready` frame's `prefix_cache`), ranked by rendezvous hashing of the key
with each worker's slot name, the first with room whose load (requests in flight) is within
`load_margin` of the least loaded worker that could take the request gets it: a quarter of its
forward's requests (`max_batch`), at least one. Otherwise, and for a request without a key,
the least loaded worker with room gets it (ties in round-robin order). Rendezvous hashing
(highest random weight) keeps every other state where it was when a worker joins or leaves, and
gives each state its own order of second choices, so a hot state spills to the same second
worker (whose cache then holds it too) while different states spill to different ones. The
margin bounds how unevenly states can load the workers; the queue is never held back for a
busy preferred worker (work-conserving).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Mapping, Sequence
from typing import Any, Protocol, TypeVar

# The smallest state span, in tokens, the worker's prefix cache stores or looks up
# (clef_worker.serving.prefix.cache.MIN_STATE_TOKENS; tests/test_balance.py keeps the two equal).
MIN_STATE_TOKENS = 256
# The shortest rendered state that gets a key: a token is at least a byte, so a shorter state
# is shorter than MIN_STATE_TOKENS whatever the tokenizer, and no worker keeps it.
KEYED_STATE_BYTES = MIN_STATE_TOKENS
# Leading bytes of the rendered state in the key: about 256 tokens of English text, so a state
# that grows by turns keeps its key from then on.
AFFINITY_BYTES = 1024
# The preferred worker may hold this share of its forward's requests more than the least
# loaded one (at least one request more).
LOAD_MARGIN_SHARE = 4
# Of each media entry's text, the key reads its length and this many characters at each end.
MEDIA_SAMPLE_CHARS = 4096
_MEDIA_FIELDS = ("images", "videos", "media_kwargs")
_MEDIA = ("images", "videos")  # what a request carries as media (media_kwargs only shape them)


class AffinityLane(Protocol):
    """A worker as the affinity step sees it."""

    def has_room(self) -> bool: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def prefix_slot(self) -> str | None:
        """The slot name to rank it by while its worker keeps a prefix cache; None while it
        keeps none (turned off, disabled by its self-check, or a worker without one)."""
        ...


LaneT = TypeVar("LaneT", bound=AffinityLane)


def prefix_key(request: Mapping[str, Any]) -> bytes | None:
    """The affinity key of a checked request: 16 bytes of BLAKE2b over its model name, media
    and the leading bytes of its rendered state (`leading_state_bytes`); None (spread by load)
    for a state under KEYED_STATE_BYTES without media, which no worker's prefix cache keeps."""
    state = leading_state_bytes(request.get("state"))
    media = [field for field in _MEDIA if request.get(field)]
    if len(state) < KEYED_STATE_BYTES and not media:
        return None
    digest = hashlib.blake2b(digest_size=16)
    model = request.get("model")
    digest.update(str(model).encode("utf-8", "surrogatepass"))
    digest.update(b"\0")
    for field in _MEDIA_FIELDS:
        value = request.get(field)
        if value is not None:
            digest.update(field.encode("ascii"))
            _digest_media(digest, value)
    digest.update(b"\0")
    digest.update(state)
    return digest.digest()


def leading_state_bytes(state: Any, limit: int = AFFINITY_BYTES) -> bytes:
    """The first `limit` bytes (UTF-8) of the state as the prompt carries it (text as is, any
    other JSON value as compact, key-sorted JSON); of a shorter state, its first power-of-two
    bytes (so a state that grows keeps its key until its length doubles)."""
    if isinstance(state, str):
        text = state[:limit]  # a character is at least one byte: enough characters
    else:
        text = json.dumps(state, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    data = text.encode("utf-8", "surrogatepass")[:limit]
    if 0 < len(data) < limit:
        data = data[:1 << (len(data).bit_length() - 1)]
    return data


def _digest_media(digest: Any, value: Any) -> None:
    """Media entries into the digest: strings by length and both ends, the rest as JSON."""
    if isinstance(value, str):
        digest.update(len(value).to_bytes(8, "little"))
        if len(value) <= 2 * MEDIA_SAMPLE_CHARS:
            digest.update(value.encode("utf-8", "surrogatepass"))
        else:
            digest.update(value[:MEDIA_SAMPLE_CHARS].encode("utf-8", "surrogatepass"))
            digest.update(value[-MEDIA_SAMPLE_CHARS:].encode("utf-8", "surrogatepass"))
    elif isinstance(value, list):
        digest.update(b"[")
        for entry in value:
            _digest_media(digest, entry)
        digest.update(b"]")
    else:
        digest.update(json.dumps(value, sort_keys=True, default=str).encode("utf-8"))


def rendezvous_order(key: bytes, names: Sequence[str]) -> list[int]:
    """The indexes of `names`, highest rendezvous weight first (ties by name)."""
    def weight(index: int) -> tuple[bytes, str]:
        name = names[index]
        score = hashlib.blake2b(key + b"\0" + name.encode("utf-8"), digest_size=8).digest()
        return score, name

    return sorted(range(len(names)), key=weight, reverse=True)


def load_margin(lane: AffinityLane) -> int:
    """How many requests more than the least loaded worker `lane` may hold and still get a
    request for a state it may have cached: a quarter of its forward, at least one."""
    return max(1, lane.max_batch // LOAD_MARGIN_SHARE)


def preferred_lane(key: bytes | None, lanes: Sequence[LaneT],
                   busy_alone: Container[LaneT]) -> LaneT | None:
    """The worker the affinity rule picks for a request with `key`, or None: the least loaded
    worker applies (no key, no worker with a prefix cache, or none of them with room within the
    load margin of the least loaded).

    `lanes`: the workers that may take the request (its model's); `busy_alone`: workers
    running a resent request alone (they take nothing else).
    """
    if key is None:
        return None
    free = [lane for lane in lanes if lane not in busy_alone and lane.has_room()]
    candidates = [lane for lane in lanes if lane.prefix_slot is not None]
    if not free or not candidates:
        return None
    least = min(lane.in_flight for lane in free)
    names = [lane.prefix_slot or "" for lane in candidates]
    for index in rendezvous_order(key, names):
        lane = candidates[index]
        if lane in free and lane.in_flight < least + load_margin(lane):
            return lane
    return None

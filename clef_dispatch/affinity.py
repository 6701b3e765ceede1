"""Prefix affinity: requests whose state starts alike go to the same worker while it has room.

Why: each worker keeps its own prefix cache (the model states of the prompts it has read,
clef_worker's prefix cache), so an agent's next turn, or another question set about the same
document, is cheap only on the worker that read the state before. Spread round robin over W
workers, a state's requests would find their prefix cached one time in W, and every worker
would spend its cache on the same states.

The front does not tokenize (the tokenizer is the worker's), so the key is taken from the
leading bytes of the request, as prefix-aware routers do: the model name (a fine-tuned variant
changes every layer, so it never shares states with the base), the media (they sit before the
state in the prompt; a digest of their text, sampled at both ends of each entry so a large
image costs no full hash on the event loop) and the first `AFFINITY_BYTES` of the state as the
worker renders it (text as is, any other JSON value as compact sorted JSON); a state shorter
than that is keyed by its first power-of-two bytes, so a short state that grows keeps its key
until its length doubles (an agent's early turns stay together) rather than changing it at
every turn. The key is a hint: two states that share their leading bytes but not more are sent
to the same worker and simply miss its cache.

The rule ("when load allows"), applied after admission's other filters and before the round
robin: among the ready workers that report a prefix cache turned on (their `ready` frame's
`prefix_cache`), ranked by rendezvous hashing of the key with each worker's slot name, the
first with room (fewer than its `max_sequences` in flight) gets the request. When none of them
has room, or the request has no key, or no worker keeps a prefix cache, the usual choice applies
(the next worker with room, round robin). Rendezvous hashing (highest random weight) keeps every
other state where it was when a worker joins or leaves, and gives each state its own order of
second choices, so a hot state spills to the same second worker (whose cache then holds it too)
while different states spill to different ones. The cap on a worker's requests in flight bounds
how unevenly states can load the workers; the queue is never held back for a busy preferred
worker (work-conserving).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Container, Mapping, Sequence
from typing import Any, Protocol, TypeVar

# Leading bytes of the rendered state in the key: about 256 tokens of text (the smallest state
# the worker caches), so a state that grows by turns keeps its key from then on.
AFFINITY_BYTES = 1024
# Of each media entry's text, the key reads its length and this many characters at each end.
MEDIA_SAMPLE_CHARS = 4096
_MEDIA_FIELDS = ("images", "videos", "media_kwargs")


class AffinityLane(Protocol):
    """A worker as the affinity step sees it."""

    def has_room(self) -> bool: ...

    @property
    def prefix_slot(self) -> str | None:
        """The slot name to rank it by while its worker keeps a prefix cache; None while it
        keeps none (turned off, disabled by its self-check, or a worker without one)."""
        ...


LaneT = TypeVar("LaneT", bound=AffinityLane)


def prefix_key(request: Mapping[str, Any]) -> bytes:
    """The affinity key of a checked request: 16 bytes of BLAKE2b over its model name, media
    and the first AFFINITY_BYTES of its rendered state."""
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
    digest.update(leading_state_bytes(request.get("state")))
    return digest.digest()


def leading_state_bytes(state: Any, limit: int = AFFINITY_BYTES) -> bytes:
    """The first `limit` bytes (UTF-8) of the state as the prompt carries it (text as is, any
    other JSON value as compact, key-sorted JSON); of a shorter state, its first power-of-two
    bytes."""
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


def preferred_lane(key: bytes | None, lanes: Sequence[LaneT],
                   busy_alone: Container[LaneT]) -> LaneT | None:
    """The worker the affinity rule picks for a request with `key`, or None: the usual choice
    applies (no key, no worker with a prefix cache, or none of them with room).

    `busy_alone`: workers running a resent request alone (they take nothing else).
    """
    if key is None:
        return None
    candidates = [lane for lane in lanes if lane.prefix_slot is not None]
    if not candidates:
        return None
    names = [lane.prefix_slot or "" for lane in candidates]
    for index in rendezvous_order(key, names):
        lane = candidates[index]
        if lane not in busy_alone and lane.has_room():
            return lane
    return None

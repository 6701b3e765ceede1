"""The worker's prefix cache: the per-layer states of token prefixes it has read, by content.

Why: Clef requests repeat their states. An agent asks a decision at every turn about a state that
only grows; a pipeline asks several question sets about one document. The state is most of the
tokens, so a request whose leading tokens were read before should compute only the rest
(clef_worker.model.prefix_forward runs that suffix from the cached states).

Keys: a chain of block hashes over token ids, as vLLM's automatic prefix caching. A block
`[start, end)` is keyed by the hash of its parent's key and its own token ids, so a key names the
whole prefix up to `end`; the chain's first parent (the root) folds in the variant (each adapter
changes every layer, so a variant never reuses the base's states) and the media's digest (media
tokens are placeholders: the pixels are not in the ids). Blocks end at every multiple of
`block_tokens` and, for the last one of a request, `END_MARGIN` tokens before the end of its
state span, rounded down to `align` tokens (so a request asking other questions about the same
state reuses nearly all of it, and the torch scan hands out the state there for free: points
are multiples of its chunk). On CUDA only that last point is stored (`StorePolicy`: each point costs
a replay round and 49 MiB of recurrent state), and a point whose state has grown past it gives
its recurrent state up: a lookup passes through such a block but never ends there.

Media requests (`system prompt + media + state + ...`): the root folds in the media's digest
(`PreparedMedia.digest`, over the decoded pixels), because the media tokens are placeholders
whose ids are the same for any two pictures of one size: without it two pictures would share
states. A block boundary inside the media span is never stored nor reused: a media request's
points lie at or after the end of its media tokens (`CacheKey.media_end`) and a lookup that
would reuse less than that reuses nothing, so a request reuses either nothing (and runs the
vision tower) or all of its media (and never runs the tower). Each block records the rotary
offset at its end (`rope_delta`: after an image, text positions lag the token index), so the
suffix continues the multimodal positions exactly as the whole forward does.

What a block keeps (what a suffix after its end needs): per Gated DeltaNet layer the recurrent
state and the short convolution's input tail at `end`; per full-attention layer the block's own
keys (after RoPE) and values; the block's final hidden states (the joint head's memory). A hit
concatenates the chain's keys, values and hidden states; the recurrent state is the last
block's alone.

Lookup walks from the root: at each block end it tries every child end known under that key
(longest first), hashing the request's ids over that span, so a request reuses the longest
cached chain whose tokens it shares, block-aligned or not (the agent's previous turn ended at
its own state's end, not at a block boundary).

Bounded in bytes: least recently used blocks go first; a hit touches its chain tail first and
head last, so a chain loses its tail before its head, and a block evicted takes its descendants
with it (they are unreachable without it). One thread uses it: the serve loop's main thread
(the runner looks up and stores while it runs a group's forward).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from clef_protocol.messages import (
    PREFIX_CACHE_NO_BYTES,
    PREFIX_CACHE_OFF_BY_FLAG,
    PrefixCacheInfo,
    PrefixStats,
)
from clef_worker.model.prefix_forward import Captured, PrefixState

# Tokens between two cached points, by device. On CPU the torch scan hands out the states at
# any chunk boundary for free, so blocks are short (a 7,000-token state is 28 of them). On CUDA
# each point costs one more round of fla's varlen call per Gated DeltaNet layer and 49 MiB of
# recurrent state at Clef-Flash's shapes (docs/operations.md), so blocks are long; the state-end
# point (below) keeps an agent's reuse close to its previous turn either way.
BLOCK_TOKENS = 256
BLOCK_TOKENS_CUDA = 2048
# A state span shorter than this is neither stored nor looked up: its prefill is cheap to redo.
MIN_STATE_TOKENS = 256
# Every cached point is a multiple of this: the torch scan's chunk (32) and fla's (64) divide
# it, so a suffix starting at a point keeps the chunking of a whole forward.
POINT_ALIGN = 64
HASH_BYTES = 16
# The state-end point stays this many tokens before the end: a state that grows usually differs
# from its previous version only in its last few tokens (a JSON array's closing `]}` followed by
# a new event), so a point right at the end would rarely be reusable by the next turn.
END_MARGIN = 16


# On CUDA a state is stored only at its end point and only from this many state tokens: each
# point stored costs one more replay of the packed buckets (the round that ends at it,
# clef_worker.serving.prefix.graphed) and 49 MiB of recurrent state, so interior block points
# (rarely reused: an agent's next turn continues from the end) and short states (cheap to recompute)
# are not worth it there. Both are switches (`StorePolicy`) for a sitting to revisit with
# measured figures.
MIN_STATE_TOKENS_CUDA = 1024


@dataclass(frozen=True)
class StorePolicy:
    """Which points a request stores: only its last (`end_only`), and none for a state
    shorter than `min_state_tokens`."""

    end_only: bool = False
    min_state_tokens: int = MIN_STATE_TOKENS


def default_store_policy(device: str) -> StorePolicy:
    """What a worker on `device` stores (see above)."""
    if device.startswith("cuda"):
        return StorePolicy(end_only=True, min_state_tokens=MIN_STATE_TOKENS_CUDA)
    return StorePolicy()


def default_block_tokens(device: str) -> int:
    """Tokens between two cached points for a worker on `device`."""
    return BLOCK_TOKENS_CUDA if device.startswith("cuda") else BLOCK_TOKENS


def root_key(variant: str, media_digest: str = "") -> bytes:
    """The chain's first parent: what every block's key is built on."""
    return hashlib.blake2b(f"clef-prefix\0{variant}\0{media_digest}".encode(),
                           digest_size=HASH_BYTES).digest()


def block_key(parent: bytes, ids: np.ndarray) -> bytes:
    """The key of a block whose parent is `parent` and whose tokens are `ids` (int64)."""
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(ids.tobytes())
    return digest.digest()


@dataclass(frozen=True)
class CacheKey:
    """What the runner needs to look a request up and store it: its chain's root, where its
    state span ends (nothing after it is stored: the schema and suffix are per request) and
    where its media tokens end (0: none; no point before it is stored or reused)."""

    root: bytes
    state_end: int
    media_end: int = 0


@dataclass
class Block:
    """One cached block `[start, end)` of a chain (see the module docs for what it keeps)."""

    key: bytes
    parent: bytes
    start: int
    end: int
    recurrent: list[Tensor]
    conv: list[Tensor]
    keys: list[Tensor]
    values: list[Tensor]
    hidden: Tensor
    rope_delta: int = 0  # the rotary position at `end` minus `end` (media before it)
    nbytes: int = 0
    children: set[bytes] = field(default_factory=set)


@dataclass(frozen=True)
class Hit:
    """A lookup's result: the chain (head first) and the tokens it covers."""

    chain: list[Block]

    @property
    def tokens(self) -> int:
        return self.chain[-1].end if self.chain else 0

    def state(self) -> PrefixState | None:
        """The states a suffix after the chain starts from (None for an empty chain)."""
        if not self.chain:
            return None
        last = self.chain[-1]
        layers = len(last.keys)
        return PrefixState(
            start=last.end, recurrent=last.recurrent, conv=last.conv,
            keys=[_joined([block.keys[i] for block in self.chain], 1) for i in range(layers)],
            values=[_joined([block.values[i] for block in self.chain], 1)
                    for i in range(layers)],
            rope_delta=last.rope_delta)

    def hidden(self) -> Tensor | None:
        """The chain's final hidden states `[tokens, H]` (None for an empty chain)."""
        return _joined([block.hidden for block in self.chain], 0) if self.chain else None


def _joined(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class PrefixCache:
    """Blocks by key, least recently used first; counts what it served (module docs)."""

    def __init__(self, capacity_bytes: int, *, block_tokens: int = BLOCK_TOKENS,
                 align: int = POINT_ALIGN, enabled: bool = True, disabled_reason: str = "",
                 policy: StorePolicy = StorePolicy()):
        if block_tokens < align or block_tokens % align:
            raise ValueError(f"block_tokens {block_tokens}: must be a multiple of {align}")
        self.capacity_bytes = capacity_bytes
        self.block_tokens = block_tokens
        self.align = align
        self.end_only = policy.end_only
        self.min_state_tokens = policy.min_state_tokens
        self.enabled = enabled and capacity_bytes > 0
        self.disabled_reason = disabled_reason if not self.enabled else ""
        if not self.enabled and not self.disabled_reason:
            self.disabled_reason = PREFIX_CACHE_NO_BYTES if enabled else PREFIX_CACHE_OFF_BY_FLAG
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.children: dict[bytes, set[bytes]] = {}  # the root's children (blocks keep theirs)
        self.bytes = 0
        self.hits = 0
        self.lookups = 0
        self.tokens_reused = 0

    # -- what the worker reports --------------------------------------------------------------

    def info(self) -> PrefixCacheInfo:
        return PrefixCacheInfo(self.enabled, self.capacity_bytes, self.block_tokens,
                               self.disabled_reason)

    def stats(self, reused_tokens: int) -> PrefixStats:
        return PrefixStats(reused_tokens=reused_tokens, bytes=self.bytes,
                           entries=len(self.blocks), hits=self.hits, lookups=self.lookups,
                           tokens_reused=self.tokens_reused)

    def disable(self, reason: str) -> None:
        """Serve without the cache from now on (the self-check's verdict), empty."""
        self.enabled = False
        self.disabled_reason = reason
        self.clear()

    def reset(self) -> None:
        """Empty, and count from zero: what the worker does before it serves (warm-up's and the
        start-up checks' blocks and lookups are nobody's)."""
        self.clear()
        self.hits = self.lookups = self.tokens_reused = 0

    def clear(self) -> None:
        """Drop every block (the weights they were computed with are no longer served)."""
        self.blocks.clear()
        self.children.clear()
        self.bytes = 0

    # -- planning -----------------------------------------------------------------------------

    def points(self, start: int, state_end: int, media_end: int = 0) -> tuple[int, ...]:
        """Where a request whose first `start` tokens are cached stores its states: every
        block end after `start` up to its state's end, and a point `END_MARGIN` tokens before
        that end rounded down to `align`; none before `media_end` (a suffix from there would
        need the vision tower). A state shorter than `min_state_tokens` stores nothing; with
        `end_only`, only the last point is stored."""
        if not self.enabled or state_end < self.min_state_tokens:
            return ()
        if media_end:
            return tuple(p for p in self.points(start, state_end) if p >= media_end)
        last = (state_end - END_MARGIN) - (state_end - END_MARGIN) % self.align
        points = list(range(start - start % self.block_tokens + self.block_tokens, last + 1,
                            self.block_tokens))
        if last > start and (not points or points[-1] != last):
            points.append(last)
        return tuple(points[-1:]) if self.end_only else tuple(points)

    # -- lookup -------------------------------------------------------------------------------

    def lookup(self, key: CacheKey, ids: np.ndarray) -> Hit:
        """The longest cached chain of `ids`' leading tokens within the state span (and short
        of the last token, which a forward must compute); counted in the stats."""
        if not self.enabled:
            return Hit([])
        self.lookups += 1
        limit = min(key.state_end, len(ids) - 1)
        chain: list[Block] = []
        parent, position = key.root, 0
        while True:
            found = self._child(parent, position, ids, limit)
            if found is None:
                break
            chain.append(found)
            parent, position = found.key, found.end
        while chain and not chain[-1].recurrent:
            chain.pop()  # a point superseded by a later one of its state: passed through only
        if chain and chain[-1].end < key.media_end:
            chain = []  # inside the media: never reused (stored chains do not end there)
        if chain:
            self.hits += 1
            self.tokens_reused += chain[-1].end
            self._touch(chain)
        return Hit(chain)

    def _child(self, parent: bytes, position: int, ids: np.ndarray, limit: int) -> Block | None:
        children = self.children.get(parent, set()) if parent not in self.blocks \
            else self.blocks[parent].children
        for end in sorted({self.blocks[child].end for child in children}, reverse=True):
            if end > limit:
                continue
            block = self.blocks.get(block_key(parent, ids[position:end]))
            if block is not None:
                return block
        return None

    def _touch(self, chain: Sequence[Block]) -> None:
        """Most recent last: the tail first, the head last (so the tail is evicted first)."""
        for block in reversed(chain):
            self.blocks.move_to_end(block.key)

    # -- storing ------------------------------------------------------------------------------

    def store(self, key: CacheKey, ids: np.ndarray, hit: Hit, captured: Captured,
              hidden: Tensor) -> None:
        """Keep the blocks a forward captured after the hit: `hidden` is the request's new
        tokens' final hidden states (`[n, H]`, from `hit.tokens` on), `captured` its states at
        its points; then evict down to the capacity."""
        if not self.enabled or not captured.points:
            return
        if hit.chain and hit.chain[-1].key not in self.blocks:
            return  # evicted since the lookup (by a neighbour's store): unreachable if kept
        start = hit.tokens
        parent = hit.chain[-1].key if hit.chain else key.root
        previous = start
        stored: list[Block] = list(hit.chain)
        for at, point in enumerate(captured.points):
            block_id = block_key(parent, ids[previous:point])
            block = self.blocks.get(block_id)
            if block is None:
                local = slice(previous - start, point - start)
                block = Block(
                    key=block_id, parent=parent, start=previous, end=point,
                    recurrent=captured.recurrent[at], conv=captured.conv[at],
                    keys=[k[:, local].clone() for k in captured.keys],
                    values=[v[:, local].clone() for v in captured.values],
                    hidden=hidden[local].clone(), rope_delta=captured.rope_deltas[at])
                block.nbytes = _nbytes([*block.recurrent, *block.conv, *block.keys,
                                        *block.values, block.hidden])
                self.blocks[block_id] = block
                self._children_of(parent).add(block_id)
                self.bytes += block.nbytes
            stored.append(block)
            parent, previous = block_id, point
        if self.end_only and hit.chain and len(stored) > len(hit.chain):
            self._supersede(hit.chain[-1])
        self._touch(stored)
        self._evict()

    def _supersede(self, block: Block) -> None:
        """Drop a point's recurrent state and convolution tail once its state has grown past
        it (the request that reused it stored a later point): an agent's next turn continues
        from the newer point, so the 49 MiB of state would only crowd the cache. The block
        keeps its keys, values and hidden states, which the newer point's chain needs; a
        lookup passes through it but never ends there."""
        freed = _nbytes([*block.recurrent, *block.conv])
        block.recurrent, block.conv = [], []
        block.nbytes -= freed
        self.bytes -= freed

    def _children_of(self, parent: bytes) -> set[bytes]:
        if parent in self.blocks:
            return self.blocks[parent].children
        return self.children.setdefault(parent, set())

    def _evict(self) -> None:
        while self.bytes > self.capacity_bytes and self.blocks:
            oldest = next(iter(self.blocks))
            self._drop(oldest)

    def _drop(self, key: bytes) -> None:
        """Remove a block and every block under it."""
        block = self.blocks.pop(key)
        self.bytes -= block.nbytes
        siblings = self.blocks[block.parent].children if block.parent in self.blocks \
            else self.children.get(block.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings and block.parent in self.children:
                del self.children[block.parent]
        for child in list(block.children):
            if child in self.blocks:
                self._drop(child)


def ids_array(ids: Sequence[int]) -> np.ndarray:
    """A request's token ids as the int64 array the keys hash."""
    return np.asarray(ids, dtype=np.int64)

"""A prefix-cache group through the packed buckets' graphs, in rounds that end at points.

Why: a group where a member continues a cached prefix or stores points used to leave the
captured graphs for the eager prefixed forward (clef_worker.model.prefix_forward: per-sequence
loops, host syncs, masked attention over repeated keys). Every bucket's forward takes state inputs
(clef_worker.model.stateful, clef_worker.serving.gpu.state_buffers), so such a group replays the
same graphs as a plain one:

- **Round r** holds every member's r-th segment, its tokens cut at its points: a member that
  stores nothing (plain, or a hit that adds no point) runs whole in round 0, from its cached
  states or from zero rows. The buckets' rows are dense (`PACK_ALIGN`, 1: segments back to
  back, no padding inside a sequence; fla's chunks are counted from each sequence's own
  start), so a segment ends exactly at its point whatever the cache's point spacing
  (`prefix_cache.POINT_ALIGN`), and the final states the replay leaves for it are exactly the
  states at the point: kept for the cache and written as its rows for the next round. The
  dummy tail sequence and the empty slot after the members keep zero rows and are never
  stored. A member's keys before its segment (cached, then earlier rounds') are copied into the
  key buffers ahead of it; the new ones are read back after the replay.
- **No host read of the device**: ids and indices are built on the host from the staged ids and
  copied without blocking; state rows and keys move device to device.
- **What does not fit** a bucket (more new tokens than the largest, or more keys than the
  buffers hold) is left to the caller: `graphable` says which members can go.

The answer of each member is its cached final hidden states followed by the new ones, as the
eager path returns it; the cache stores what the rounds captured (`PrefixCache.store`).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clef_worker.model.packed import aligned_length, to_device
from clef_worker.model.prefix_forward import Captured, MediaInputs
from clef_worker.serving.gpu.packed_graphs import PACK_ALIGN, PackedGraphRunner, aligned_offsets
from clef_worker.serving.gpu.state_buffers import RowSequence
from clef_worker.serving.prefix.cache import CacheKey, Hit, PrefixCache
from clef_worker.serving.prefix.run import GroupPlan, run_group

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One request of the group as the rounds see it."""

    index: int  # in the group
    hit: Hit
    length: int
    points: tuple[int, ...]
    slot: int = 0  # its variant's slot
    # Its states before its next segment, per Gated DeltaNet layer: [Hv, dk, dv] and [K-1, D].
    recurrent: Sequence[Tensor] = ()
    conv: Sequence[Tensor] = ()
    # Its keys and values so far in parts (each cached block, then each round), per attention
    # layer `[n, Hkv, d]` (views of the blocks' `[Hkv, n, d]`: copied once, into the buffers).
    keys: list[list[Tensor]] = field(default_factory=list)
    values: list[list[Tensor]] = field(default_factory=list)
    hidden: list[Tensor] = field(default_factory=list)
    captured: Captured | None = None
    key_at: int = 0  # where its keys start in the key buffers this round

    @property
    def start(self) -> int:
        return self.hit.tokens

    def segments(self) -> list[tuple[int, int]]:
        cuts = [self.start, *(p for p in self.points if self.start < p < self.length),
                self.length]
        return list(itertools.pairwise(cuts))


def graphable(graphs: PackedGraphRunner, start: int, length: int) -> bool:
    """Whether a member's new tokens fit the largest bucket and its keys the key buffers beside
    a full row."""
    states = graphs.states
    if states is None or not graphs.static:
        return False
    largest = max(graphs.static)
    return (aligned_length(length - start, PACK_ALIGN) <= largest
            and aligned_length(length, PACK_ALIGN) <= states.capacity - largest)


def batches(graphs: PackedGraphRunner, members: Sequence[Member]) -> list[list[Member]]:
    """Members in order, split where the next would overflow a round (the largest bucket, the
    key buffers, the sequences a row holds)."""
    assert graphs.states is not None
    largest = max(graphs.static)
    room = graphs.states.capacity - largest
    out: list[list[Member]] = []
    tokens = keys = 0
    for member in members:
        new = aligned_length(member.length - member.start, PACK_ALIGN)
        own = aligned_length(member.length, PACK_ALIGN)
        if out and (tokens + new <= largest and keys + own <= room
                    and len(out[-1]) < graphs.max_sequences):
            out[-1].append(member)
            tokens, keys = tokens + new, keys + own
        else:
            out.append([member])
            tokens, keys = new, own
    return out


def run_members(graphs: PackedGraphRunner, cache: PrefixCache, members: Sequence[Member],
                keys: Sequence[CacheKey | None], host_ids: Sequence[np.ndarray]
                ) -> dict[int, Tensor]:
    """Every member's final hidden states `[length, H]` (cached then new) by group index;
    stores what each captured."""
    for member in members:
        if member.hit.chain:
            last = member.hit.chain[-1]
            member.recurrent, member.conv = last.recurrent, last.conv
            member.keys = [[k.transpose(0, 1) for k in block.keys] for block in member.hit.chain]
            member.values = [[v.transpose(0, 1) for v in block.values]
                             for block in member.hit.chain]
        member.captured = Captured(member.points, [], [])
    for batch in batches(graphs, members):
        for round_index in itertools.count():
            active = [(m, m.segments()[round_index]) for m in batch
                      if round_index < len(m.segments())]
            if not active:
                break
            _run_round(graphs, active, host_ids)
    out = {}
    for member in members:
        new = torch.cat(member.hidden) if len(member.hidden) > 1 else member.hidden[0]
        cached = member.hit.hidden()
        out[member.index] = new if cached is None else torch.cat([cached, new.to(cached.dtype)])
        key = keys[member.index]
        captured = member.captured
        assert captured is not None
        if key is not None and member.points:
            own = len(member.hit.chain)  # the cached parts are not the member's to store
            captured.keys = _joined(member.keys[own:])
            captured.values = _joined(member.values[own:])
            cache.store(key, host_ids[member.index], member.hit, captured, new)
    return out


def _run_round(graphs: PackedGraphRunner, active: Sequence[tuple[Member, tuple[int, int]]],
               host_ids: Sequence[np.ndarray]) -> None:
    """One replay of the members' segments (module docs)."""
    states = graphs.states
    assert states is not None
    lengths = [end - start for _, (start, end) in active]
    bucket = graphs.bucket_for(lengths)
    if bucket is None:
        raise ValueError(f"segments of {lengths} tokens fit no built bucket")
    states.clear_rows()
    key_at = 0
    for slot, (member, (start, end)) in enumerate(active):
        if member.recurrent:
            torch._foreach_copy_(list(states.recurrent[:, slot].unbind(0)), list(member.recurrent))
            torch._foreach_copy_(list(states.conv[:, slot].unbind(0)), list(member.conv))
            states.dirty.add(slot)
        for buffer, parts in ((states.keys, member.keys), (states.values, member.values)):
            at, targets, sources = key_at, [], []
            for part in parts:
                if not part:  # a stack without attention layers keeps no keys
                    continue
                rows = part[0].shape[0]
                targets += list(buffer[:, at:at + rows].unbind(0))
                sources += part
                at += rows
            if targets:
                torch._foreach_copy_(targets, sources)
        member.key_at = key_at
        # its keys in the buffers: cached ones then its row span (StateBuffers.fill's offsets)
        key_at += start + aligned_length(end - start, PACK_ALIGN)
    row, _ = graphs.host_ids([host_ids[m.index][a:b].tolist() for m, (a, b) in active],
                             bucket)
    device = states.device
    variant = (to_device(graphs.host_slots(lengths, [m.slot for m, _ in active], bucket),
                         device) if graphs.selection is not None else None)
    rope = [m.hit.chain[-1].rope_delta if m.hit.chain else 0 for m, _ in active]
    hidden = graphs.run(to_device(row, device), lengths, bucket, variant,
                        [RowSequence(end - start, start + delta, start)
                         for (_, (start, end)), delta in zip(active, rope, strict=True)])
    for slot, ((member, (start, end)), at) in enumerate(
            zip(active, aligned_offsets(lengths), strict=True)):
        member.hidden.append(hidden[at:at + end - start].clone())
        first = member.key_at + start
        member.keys.append(list(states.keys[:, first:first + end - start].clone().unbind(0)))
        member.values.append(list(states.values[:, first:first + end - start].clone()
                                  .unbind(0)))
        if end in member.points:
            # The states at the point: this slot's rows of the replay's outputs, copied out
            # (the next replay overwrites them), one copy per kind.
            member.recurrent = torch.stack([r[slot] for r in graphs.outputs.recurrent]).unbind(0)
            member.conv = torch.stack([c[slot] for c in graphs.outputs.conv]).unbind(0)
            assert member.captured is not None
            member.captured.recurrent.append(list(member.recurrent))
            member.captured.conv.append(list(member.conv))
            member.captured.rope_deltas.append(
                member.hit.chain[-1].rope_delta if member.hit.chain else 0)


@dataclass(frozen=True)
class GroupRun:
    """What the runner hands over for a prefix-cache group (clef_worker.serving.runner)."""

    backbone: Any
    cache: PrefixCache
    plan: GroupPlan
    lengths: Sequence[int]
    real_ids: Tensor  # the group's ids end to end, on the device
    keys: Sequence[CacheKey | None]
    host_ids: Sequence[np.ndarray]
    slots: Sequence[int]  # each member's variant slot
    media: bool  # a lone media request: always the eager path
    # The adapter selection for the eager path's spans of these members.
    selected: Callable[[list[tuple[int, int]], list[int]], AbstractContextManager[Any]]
    media_inputs: Callable[[Tensor], MediaInputs] | None = None


def prefixed_hidden(group: GroupRun, graphs: PackedGraphRunner | None,
                    paths: Counter[str]) -> Tensor:
    """The group's final hidden states end to end: the members that fit the packed buckets
    replay them in rounds; a media request and members too long for the buckets run the eager
    prefixed forward (clef_worker.serving.prefix.run) by themselves, never taking the others with
    them. `paths` counts the groups by path ("graphed", "eager"; a split group in both)."""
    plan, lengths = group.plan, group.lengths
    members = []
    if graphs is not None and not group.media:
        members = [Member(i, hit, length, points, group.slots[i]) for i, (hit, length, points)
                   in enumerate(zip(plan.hits, lengths, plan.points, strict=True))
                   if graphable(graphs, hit.tokens, length)]
    parts: dict[int, Tensor] = {}
    if members:
        assert graphs is not None
        parts = run_members(graphs, group.cache, members, group.keys, group.host_ids)
        paths["graphed"] += 1
        if paths["graphed"] == 1:
            log.info("prefix-cache groups replay the packed buckets (first: %d requests, "
                     "%d reused tokens)", len(members), sum(m.start for m in members))
    rest = [i for i in range(len(lengths)) if i not in parts]
    if rest:
        starts = [0, *itertools.accumulate(lengths)]
        ids = torch.cat([group.real_ids[starts[i]:starts[i + 1]] for i in rest])
        hidden = run_group(
            group.backbone, group.cache,
            GroupPlan([plan.hits[i] for i in rest], [plan.points[i] for i in rest]),
            [lengths[i] for i in rest], ids, [group.keys[i] for i in rest],
            [group.host_ids[i] for i in rest], lambda spans: group.selected(spans, rest),
            group.media_inputs)
        at = 0
        for i in rest:
            parts[i] = hidden[at:at + lengths[i]]
            at += lengths[i]
        paths["eager"] += 1
        if paths["eager"] == 1:
            log.info("a prefix-cache group ran the eager prefixed forward (first: %d requests; "
                     "%s)", len(rest), "no packed buckets" if graphs is None else
                     "media" if group.media else "too long for the buckets")
    ordered = [parts[i] for i in range(len(lengths))]
    return ordered[0] if len(ordered) == 1 else torch.cat(ordered)


def _joined(parts: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """Per attention layer, the parts' `[n, Hkv, d]` rows joined, as the cache keeps them
    (`[Hkv, n, d]`)."""
    return [torch.cat([part[layer] for part in parts]).transpose(0, 1)
            for layer in range(len(parts[0]))]

"""A group's forward through the prefix cache: look its requests up, run only their new tokens,
join the cached hidden states before them, store what they captured.

Why a module of its own: the runner (clef_worker.serving.runner) decides which forward a group
takes; what the cached one does (which requests reuse what, where each stores, how the head's rows
are put back together) is this module's one job. Everything here runs on the main thread, in
the group's device half, so a group staged while the previous one ran sees that one's blocks.

A media request (alone in its group) either reuses a prefix covering all its media tokens, and
then runs only text (the vision tower does not run), or reuses nothing and runs from nothing
with the tower's embeddings and rotary rows (`media_inputs`), storing its points after the
media (clef_worker.serving.prefix.cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clef_worker.model.prefix_forward import (
    MediaInputs,
    SequencePlan,
    delta_rule_for,
    prefixed_forward,
)
from clef_worker.serving.prefix.cache import CacheKey, Hit, PrefixCache


@dataclass(frozen=True)
class GroupPlan:
    """Each request's cached chain and the points where it stores its states."""

    hits: list[Hit]
    points: list[tuple[int, ...]]

    @property
    def reused(self) -> list[int]:
        return [hit.tokens for hit in self.hits]


def plan_group(cache: PrefixCache | None, keys: Sequence[CacheKey | None],
               host_ids: Sequence[np.ndarray]) -> GroupPlan | None:
    """The group's plan when it uses the prefix cache (a member reuses a prefix or stores
    one); None otherwise, and the group runs as it would without a cache."""
    if cache is None or not cache.enabled or not keys:
        return None
    hits, points = [], []
    for key, ids in zip(keys, host_ids, strict=True):
        hit = cache.lookup(key, ids) if key is not None else Hit([])
        hits.append(hit)
        points.append(cache.points(hit.tokens, key.state_end, key.media_end)
                      if key is not None else ())
    if not any(hit.chain for hit in hits) and not any(points):
        return None
    return GroupPlan(hits, points)


def run_group(backbone: Any, cache: PrefixCache, plan: GroupPlan, lengths: Sequence[int],
              ids: Tensor, keys: Sequence[CacheKey | None], host_ids: Sequence[np.ndarray],
              selected: Callable[[list[tuple[int, int]]], AbstractContextManager[Any]],
              media_inputs: Callable[[Tensor], MediaInputs] | None = None) -> Tensor:
    """Every request's final hidden states end to end (`ids`: the group's ids end to end on the
    device): only the new tokens run (clef_worker.model.prefix_forward), under `selected`
    (the variants' adapter selection for the new tokens' spans); then each request's captured
    blocks are stored. `media_inputs`: a lone media request's embeddings and rotary rows from
    its ids, called only when it reuses nothing (a reused prefix covers all its media)."""
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    new_ids = torch.cat([ids[offset + hit.tokens:offset + length] for offset, hit, length in
                         zip(offsets, plan.hits, lengths, strict=False)])
    plans = [SequencePlan(length - hit.tokens, hit.state(), marks)
             for length, hit, marks in zip(lengths, plan.hits, plan.points, strict=True)]
    spans, at = [], 0
    for sequence in plans:
        spans.append((at, at + sequence.length))
        at += sequence.length
    with selected(spans):
        media = None
        if media_inputs is not None and plan.hits[0].tokens == 0:
            media = media_inputs(new_ids)
        new_hidden, captured = prefixed_forward(backbone.model, new_ids, plans,
                                                delta_rule_for(backbone.gdn_path), media)
    parts = []
    for index, ((start, end), hit) in enumerate(zip(spans, plan.hits, strict=True)):
        part = new_hidden[start:end]
        cached = hit.hidden()
        parts.append(part if cached is None else torch.cat([cached, part.to(cached.dtype)]))
        key = keys[index]
        if key is not None:
            cache.store(key, host_ids[index], hit, captured[index], part)
    return parts[0] if len(parts) == 1 else torch.cat(parts)

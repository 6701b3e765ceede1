"""A group's run, as data: what the runner's host half hands its device half (`Staged`, every int64
tensor in one flat buffer so one copy moves it; `VariantHeads`, a mixed group's head passes per
fine-tuned variant) and what the device half gives back (`RunOutput`, `RowResult`, with the stage
times `StageClock` measures without synchronising the device). Apart from the runner
(clef_worker.serving.runner) so its two halves read as the steps they are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from clef_worker.media.vision import PreparedMedia
from clef_worker.model.head_batch import HeadBatch, RecordSpans
from clef_worker.serving.gpu.graphs import Step
from clef_worker.serving.prefix.cache import CacheKey


@dataclass(frozen=True)
class RowResult:
    """One request's values, and how many requests the forward that produced them held."""

    logits: list[float]
    probabilities: list[float]
    batch_size: int
    reused_tokens: int = 0  # leading tokens read from the prefix cache instead of computed


@dataclass(frozen=True)
class RunOutput:
    """A group's results in request order, and the group's stage times (`forward_ms`,
    `head_ms`)."""

    rows: list[RowResult]
    stages: dict[str, float] = field(default_factory=dict)
    # The real tokens' last hidden states end to end [sum T, H], on the device: only when asked
    # (`keep_hidden`, the start-up self-check compares them token by token).
    hidden: Tensor | None = None


class StageClock:
    """Marks points in a group's run and reports the time between them, without synchronising
    the device: CUDA events on CUDA (read once the caller has synchronised), the host clock on
    CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[torch.cuda.Event | float] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        """Milliseconds between consecutive marks; on CUDA only after a synchronisation."""
        spans = []
        for start, end in zip(self.marks, self.marks[1:], strict=False):
            if isinstance(start, float) and isinstance(end, float):
                spans.append((end - start) * 1000.0)
            else:
                assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
                end.synchronize()
                spans.append(float(start.elapsed_time(end)))
        return [round(span, 3) for span in spans]


@dataclass
class Staged:
    """A group's host half: what `run_staged` needs, every int64 tensor in one flat buffer."""

    lengths: list[int]
    steps: list[Step]  # padded layout (and media): the forwards; empty when packed
    bucket: int | None  # packed layout: the graph bucket (None: an eager packed row)
    flat: Tensor  # every host tensor below, flattened into one (pinned on CUDA)
    shapes: list[torch.Size]
    batch: HeadBatch  # index tensors still on the host (replaced by the moved ones)
    media: PreparedMedia | None = None
    # Fine-tuned variants (clef_worker.variants): each request's slot (0: the base) and, when
    # the group mixes slots, one head pass per slot (`VariantHeads`).
    slots: list[int] = field(default_factory=list)
    heads: VariantHeads | None = None
    bucket_slots: bool = False  # a packed bucket's per-position slots follow its ids
    step_slots: bool = False  # padded: each step's per-token slots follow its ids
    # The prefix cache (clef_worker.serving.prefix.cache): each request's key (None: not cacheable)
    # and its ids as the keys hash them; empty without a cache.
    cache_keys: list[CacheKey | None] = field(default_factory=list)
    host_ids: list[np.ndarray] = field(default_factory=list)

    @property
    def forward_tensors(self) -> int:
        """How many of the flat tensors the forward reads (the head's follow)."""
        if self.bucket is not None:
            return 3 if self.bucket_slots else 2
        return 1 if self.packed else len(self.steps) * (2 if self.step_slots else 1) + 1

    @property
    def packed(self) -> bool:
        return not self.steps


@dataclass
class VariantHeads:
    """A mixed group's head passes: per slot, its members (request indices), the rows of its
    members' tokens in the group's end-to-end hidden state, and their own `HeadBatch`."""

    groups: list[tuple[int, list[int], Tensor, HeadBatch]]

    def tensors(self) -> list[Tensor]:
        return [t for _, _, rows, batch in self.groups for t in (rows, *batch.tensors())]

    def count(self) -> int:
        return sum(1 + len(batch.tensors()) for _, _, _, batch in self.groups)

    def with_tensors(self, tensors: Sequence[Tensor]) -> VariantHeads:
        groups, at = [], 0
        for slot, members, _, batch in self.groups:
            width = len(batch.tensors())
            groups.append((slot, members, tensors[at],
                           batch.with_tensors(tensors[at + 1:at + 1 + width])))
            at += 1 + width
        return VariantHeads(groups)

    @classmethod
    def build(cls, slots: Sequence[int], records: Sequence[RecordSpans]) -> VariantHeads:
        starts = [0]
        for record in records[:-1]:
            starts.append(starts[-1] + record.tokens)
        groups = []
        for slot in sorted(set(slots)):
            members = [i for i, s in enumerate(slots) if s == slot]
            rows = torch.cat([torch.arange(starts[i], starts[i] + records[i].tokens)
                              for i in members])
            groups.append((slot, members, rows, HeadBatch.build([records[i] for i in members])))
        return cls(groups)

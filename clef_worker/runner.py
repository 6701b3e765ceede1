"""The model runner: encoded requests in, per-option logits and probabilities out.

One job: run the loaded model over a group of encodings, as few forwards as the plan says. It
builds the host tensors (right-padded ids per forward, the real ids end to end, the head's index
tensors), moves them in one packed copy (clef_worker.gpu.transfer), takes the last hidden state
of every request's real rows (a graph replay, an eager forward, or the vision tower for media),
and runs the joint head once over all of them. It knows nothing about request bodies, limits or
replies: that is the executor's job (clef_worker.native).

Stage times: the forward and the head are timed for every group (`RunOutput.stages`, which
travels in response frames for tracing). On CUDA they are CUDA events, read after the head's
device-to-host copy has synchronised anyway, so timing adds no synchronisation; on CPU the host
clock is the device clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from clef_worker.gpu.graphs import GraphRunner, Step
from clef_worker.gpu.transfer import to_device_packed
from clef_worker.media.vision import PreparedMedia, VisionTower
from clef_worker.model.backbone import Backbone
from clef_worker.model.encoding import Encoding
from clef_worker.model.head import HeadBatch, JointSchemaHead, RecordSpans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowResult:
    """One request's values, and how many requests the forward that produced them held."""

    logits: list[float]
    probabilities: list[float]
    batch_size: int


@dataclass(frozen=True)
class RunOutput:
    """A group's results in request order, and the group's stage times (`forward_ms`,
    `head_ms`)."""

    rows: list[RowResult]
    stages: dict[str, float] = field(default_factory=dict)


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


class ModelRunner:
    """The loaded model on one device: backbone, head, vision tower, and the graph runner
    that replays fixed shapes (None: every forward eager and unpadded)."""

    def __init__(self, backbone: Backbone, head: JointSchemaHead, pad_id: int,
                 vision: VisionTower | None = None, graphs: GraphRunner | None = None):
        self.backbone = backbone
        self.head = head
        self.pad_id = pad_id
        self.vision = vision
        self.graphs = graphs

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    def padded_length(self, length: int) -> int:
        """Row length of a forward whose longest request has `length` tokens."""
        return self.graphs.padded_length(length) if self.graphs is not None else length

    def plan(self, lengths: Sequence[int]) -> list[Step]:
        """The forwards that answer requests of these lengths (clef_worker.gpu.graphs)."""
        if self.graphs is None:
            return [Step(tuple(range(len(lengths))), None)]
        return self.graphs.plan(lengths)

    def run(self, encodings: Sequence[Encoding],
            medias: Sequence[PreparedMedia | None] = ()) -> RunOutput:
        """Backbone and head over the group: per request, per-option logits and probabilities
        (question order, then encode order). A media request must be alone in its group."""
        media = next((m for m in medias if m is not None), None)
        if media is not None and len(encodings) > 1:
            raise ValueError("a media request runs alone, not in a group of "
                             f"{len(encodings)}")
        lengths = [len(encoding.input_ids) for encoding in encodings]
        steps = [Step((0,), None)] if media is not None else self.plan(lengths)
        clock = StageClock(self.device)
        clock.mark()
        with torch.inference_mode():
            step_ids = [self._padded_ids(encodings, lengths, step) for step in steps]
            real_ids = torch.cat([torch.tensor(encoding.input_ids, dtype=torch.long)
                                  for encoding in encodings])
            batch = HeadBatch.build([RecordSpans(
                tokens=length, question_spans=[q.question_span for q in encoding.questions],
                option_spans=[q.option_spans for q in encoding.questions],
                question_types=[q.type_id for q in encoding.questions])
                for encoding, length in zip(encodings, lengths, strict=True)])
            moved = to_device_packed([*step_ids, real_ids, *batch.tensors()], self.device)
            device_ids, real_ids = moved[:len(steps)], moved[len(steps)]
            batch = batch.with_tensors(moved[len(steps) + 1:])
            if media is not None and self.vision is not None:
                rows = [self.vision.hidden_states(self.backbone, device_ids[0][0, :lengths[0]],
                                                  media)]
            else:
                rows = self._hidden_rows(steps, device_ids, lengths)
            clock.mark()
            outputs = self.head.forward_batch(rows[0] if len(rows) == 1 else torch.cat(rows),
                                              real_ids, self.backbone.lexical_table, batch)
            values = torch.cat([torch.stack([o.logits, o.probabilities]) for o in outputs],
                               dim=1).cpu()
            clock.mark()
        sizes = [0] * len(encodings)
        for step in steps:
            for member in step.members:
                sizes[member] = len(step.members)
        forward_ms, head_ms = clock.spans_ms()
        results = [RowResult(logits.tolist(), probabilities.tolist(), size)
                   for (logits, probabilities), size in zip(
                       values.split(list(batch.option_counts), dim=1), sizes, strict=True)]
        return RunOutput(results, {"forward_ms": forward_ms, "head_ms": head_ms})

    def _padded_ids(self, encodings: Sequence[Encoding], lengths: list[int],
                    step: Step) -> Tensor:
        """The host ids of one forward: its requests right-padded to the step's shape (pad rows
        up to its rows), or to the longest of them for an eager forward."""
        rows, width = step.shape or (len(step.members),
                                     max(lengths[member] for member in step.members))
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        for row, member in enumerate(step.members):
            ids[row, :lengths[member]] = torch.tensor(encodings[member].input_ids,
                                                      dtype=torch.long)
        return ids

    def _hidden_rows(self, steps: list[Step], device_ids: list[Tensor],
                     lengths: list[int]) -> list[Tensor]:
        """Every request's real rows of the last hidden state ([T_b, H] each), in request
        order. A replay's output is a static buffer the next replay overwrites, so with more
        than one step each step's rows are copied out before the next runs."""
        rows: list[Tensor | None] = [None] * len(lengths)
        for step, ids in zip(steps, device_ids, strict=True):
            if self.graphs is not None:
                hidden = self.graphs.run(ids, step.shape)
            else:
                hidden = self.backbone.last_hidden_state(ids)
            for row, member in enumerate(step.members):
                part = hidden[row, :lengths[member]]
                rows[member] = part.clone() if len(steps) > 1 else part
        assert all(row is not None for row in rows)
        return rows  # type: ignore[return-value]


def warm_row_counts(backbone: Backbone, row_counts: Sequence[int], length: int) -> None:
    """Run one Gated DeltaNet layer at each row count, so fla's kernels whose autotune key
    includes the batch size (its chunked cumulative sum) are tuned at start-up, not by the first
    request that arrives with company (a stall of seconds)."""
    mixer = backbone.gdn_layer()
    if mixer is None:
        return
    generator = torch.Generator(device="cpu").manual_seed(0)
    with torch.inference_mode():
        for rows in row_counts:
            noise = torch.randn(rows, length, backbone.hidden_size, generator=generator)
            mixer(noise.to(backbone.device, backbone.dtype))
    if backbone.device.type == "cuda":
        torch.cuda.synchronize(backbone.device)

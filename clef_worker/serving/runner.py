"""The model runner: encoded requests in, per-option logits and probabilities out.

One job: run the loaded model over a group of encodings, as few forwards as the layout says. Two
halves, so the host half can run on the serve loop's helper thread (clef_worker.serving.batching)
while the device runs the previous group:

- `stage` (host only, no CUDA call but pinning): the forward's ids in the group's layout, the
  head's index tensors, all int64 in one flat host buffer, pinned on CUDA
  (clef_worker.serving.gpu.transfer).
- `run_staged` (main thread): one copy to the device, the backbone's last hidden state, and the
  joint head once over every request of the group.

Layouts (the batch policy's, clef_worker.serving.policy):

- **packed**: the requests' tokens end to end in one row with cumulative offsets
  (clef_worker.model.packed); no padding. A graph bucket (clef_worker.serving.gpu.packed_graphs)
  holds the requests back to back, padding after them; the head then reads each request's rows from
  its offset (one gather), and eagerly the row is already the requests' real tokens end to end.
- **padded**: right-padded `[rows, bucket]` forwards as `GraphRunner.plan` chooses them.
- **per-group** (CPU's `auto`, eager only): each group padded when its lengths are uniform
  enough, else packed (`clef_worker.serving.policy.group_layout`, the one place that decides).

**Prefix cache** (clef_worker.serving.prefix.cache, when the runner has one;
clef_worker.serving.prefix.run runs it): at run time each request of the group is looked up by
its token ids; when any member reuses a cached prefix or has states to store, only the new
tokens run, each from its cached states: through the packed buckets' replays in rounds that end
at the points (clef_worker.serving.prefix.graphed), or, without buckets (and for a media request
or a member too long for them), through the eager prefixed forward
(clef_worker.model.prefix_forward); the head reads the cached hidden states joined before the
new ones, and the blocks each member captured are stored. A group where no member does either
runs as above.

Media requests run alone, eagerly. Through the prefix cache too, keyed by their media's digest
as well: one that reuses a prefix (always covering all its media) runs only its text after it,
without the vision tower; one that stores runs from nothing through the prefixed forward with
the tower's embeddings and multimodal rotary positions; otherwise through the vision path.
It knows nothing about request bodies, limits or replies: that is the executor's job
(clef_worker.native).

Stage times: the forward and the head are timed for every group (`RunOutput.stages`, which
travels in response frames for tracing). On CUDA they are CUDA events, read after the head's
device-to-host copy has synchronised anyway, so timing adds no synchronisation; on CPU the host
clock is the device clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from clef_worker.media.vision import PreparedMedia, VisionTower
from clef_worker.model.backbone import Backbone
from clef_worker.model.encoding import Encoding
from clef_worker.model.head import HeadOutput, JointSchemaHead
from clef_worker.model.head_batch import HeadBatch, RecordSpans
from clef_worker.model.lora import BASE_SLOT, AdapterSelection
from clef_worker.model.packed import PackedLayout
from clef_worker.model.prefix_forward import MediaInputs
from clef_worker.serving.gpu.graphs import GraphRunner, Step
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner, aligned_total
from clef_worker.serving.gpu.transfer import move_staged, stage_host
from clef_worker.serving.policy import PACKED, PADDED, group_layout
from clef_worker.serving.prefix.cache import CacheKey, PrefixCache, ids_array
from clef_worker.serving.prefix.graphed import GroupRun, prefixed_hidden
from clef_worker.serving.prefix.run import GroupPlan, plan_group
from clef_worker.serving.staging import RowResult, RunOutput, StageClock, Staged, VariantHeads

log = logging.getLogger(__name__)


class ModelRunner:
    """The loaded model on one device: backbone, head, vision tower, and the graph runner
    that replays fixed shapes (padded: `GraphRunner`; packed: `PackedGraphRunner`; None: every
    forward eager and unpadded)."""

    def __init__(self, backbone: Backbone, head: JointSchemaHead, pad_id: int,
                 vision: VisionTower | None = None,
                 graphs: GraphRunner | PackedGraphRunner | None = None,
                 layout: str = PADDED, variant_heads: Sequence[JointSchemaHead] = (),
                 selection: AdapterSelection | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.backbone = backbone
        self.head = head
        # Slot 0 is the base head; slot i the i-th fine-tuned variant's (clef_worker.variants),
        # whose LoRA layers read `selection` during each forward.
        self.heads = [head, *variant_heads]
        self.selection = selection
        self.pad_id = pad_id
        self.vision = vision
        self.graphs = graphs
        self.layout = layout
        self.prefix_cache = prefix_cache
        # Prefix-cache groups by the path they took: "graphed" (the packed buckets' replays,
        # clef_worker.serving.prefix.graphed) or "eager" (the prefixed forward); a group split
        # between both counts once in each.
        self.prefix_paths: Counter[str] = Counter()
        if graphs is not None and (layout not in (PACKED, PADDED) or isinstance(
                graphs, PackedGraphRunner) != (layout == PACKED)):
            raise ValueError(f"a {layout} runner cannot use {type(graphs).__name__}")

    @property
    def device(self) -> torch.device:
        return self.backbone.device

    @property
    def packed(self) -> bool:
        return self.layout == PACKED

    def packs(self, lengths: Sequence[int]) -> bool:
        """Whether a group of requests of these lengths runs as one packed row (the layout's
        choice for the group: clef_worker.serving.policy.group_layout)."""
        return group_layout(self.layout, lengths) == PACKED

    def batch_tokens(self, lengths: Sequence[int]) -> int:
        """A forward's cost against `--max-batch-tokens`, in the layout the group would run
        in: packed, its real tokens (`aligned_total`: back to back when graphs replay them);
        padded, rows x the longest's bucket."""
        if self.packs(lengths):
            return aligned_total(lengths) if self.graphs is not None else sum(lengths)
        longest = max(lengths)
        padded = (self.graphs.padded_length(longest) if isinstance(self.graphs, GraphRunner)
                  else longest)
        return len(lengths) * padded

    def plan(self, lengths: Sequence[int]) -> list[Step]:
        """The padded forwards that answer requests of these lengths
        (clef_worker.serving.gpu.graphs)."""
        if not isinstance(self.graphs, GraphRunner):
            return [Step(tuple(range(len(lengths))), None)]
        return self.graphs.plan(lengths)

    def run(self, encodings: Sequence[Encoding],
            medias: Sequence[PreparedMedia | None] = (), slots: Sequence[int] = (),
            keep_hidden: bool = False,
            cache_keys: Sequence[CacheKey | None] = (),
            shape: Sequence[int] | None = None) -> RunOutput:
        """Backbone and head over the group: per request, per-option logits and probabilities
        (question order, then encode order), each by its variant's slot (none given: the base).
        A media request must be alone in its group. `keep_hidden`: the output also holds the
        last hidden states. `cache_keys`: each request's prefix-cache key (none given: the
        cache is not used). `shape`: the fixed graph shape to replay, `[rows, tokens]` as
        `graph_shapes` lists it (a packed bucket is `[1, tokens]`), instead of the smallest
        that holds the group (`forced_step`)."""
        return self.run_staged(self.stage(encodings, medias, slots, cache_keys, shape),
                               keep_hidden)

    # -- host half ---------------------------------------------------------------------------

    def stage(self, encodings: Sequence[Encoding],
              medias: Sequence[PreparedMedia | None] = (), slots: Sequence[int] = (),
              cache_keys: Sequence[CacheKey | None] = (),
              shape: Sequence[int] | None = None) -> Staged:
        """The group's host tensors in one flat buffer (pinned on CUDA); no device work.
        `shape`: as `run`'s."""
        slots = list(slots) or [BASE_SLOT] * len(encodings)
        if any(slot >= len(self.heads) or slot < 0 for slot in slots):
            raise ValueError(f"variant slots {slots} beyond the {len(self.heads) - 1} loaded")
        media = next((m for m in medias if m is not None), None)
        if media is not None and len(encodings) > 1:
            raise ValueError("a media request runs alone, not in a group of "
                             f"{len(encodings)}")
        lengths = [len(encoding.input_ids) for encoding in encodings]
        forced = (self.forced_step(lengths, shape, media is not None, cache_keys)
                  if shape is not None else None)
        ids = [encoding.input_ids for encoding in encodings]
        records = [RecordSpans(
            tokens=length, question_spans=[q.question_span for q in encoding.questions],
            option_spans=[q.option_spans for q in encoding.questions],
            question_types=[q.type_id for q in encoding.questions])
            for encoding, length in zip(encodings, lengths, strict=True)]
        batch = HeadBatch.build(records)
        heads = VariantHeads.build(slots, records) if len(set(slots)) > 1 else None
        real_ids = torch.cat([torch.tensor(tokens, dtype=torch.long) for tokens in ids])
        steps: list[Step] = []
        bucket = None
        bucket_slots = step_slots = False
        # A lone request without packed graphs is a batch of one row: the plain forward is the
        # same answer without the packed kernels' per-sequence bookkeeping (on CPU it measured
        # about 15 % faster alone).
        lone = len(lengths) == 1 and not isinstance(self.graphs, PackedGraphRunner)
        if media is None and not lone and self.packs(lengths):
            graphs = self.graphs if isinstance(self.graphs, PackedGraphRunner) else None
            bucket = (forced.shape[1] if forced is not None and forced.shape is not None
                      else graphs.bucket_for(lengths) if graphs is not None else None)
            if graphs is not None and bucket is not None:
                row, real_rows = graphs.host_ids(ids, bucket)
                tensors = [row, real_rows]
                if graphs.selection is not None:
                    tensors.append(graphs.host_slots(lengths, slots, bucket))
                    bucket_slots = True
            else:
                tensors = [real_ids]
        else:
            steps = [Step((0,), None)] if media is not None or self.packed else \
                [forced] if forced is not None else self.plan(lengths)
            padded = self.graphs if isinstance(self.graphs, GraphRunner) else None
            # Variants over padded shapes: each forward's slot index, sized to its rows and
            # tokens (pad rows included), staged with its ids for a replay to copy in.
            step_slots = media is None and padded is not None and padded.selection is not None
            tensors = []
            for step in steps:
                step_ids = self._padded_ids(ids, lengths, step)
                tensors.append(step_ids)
                if step_slots:
                    assert padded is not None
                    tensors.append(padded.host_slots([slots[m] for m in step.members],
                                                     *step_ids.shape))
            tensors.append(real_ids)
        tensors += batch.tensors()
        if heads is not None:
            tensors += heads.tensors()
        keys: list[CacheKey | None] = []
        if self.prefix_cache is not None and self.prefix_cache.enabled:
            keys = list(cache_keys)
        return Staged(lengths, steps, bucket, stage_host(tensors, self.device),
                      [t.shape for t in tensors], batch, media, slots, heads, bucket_slots,
                      step_slots, keys, [ids_array(tokens) for tokens in ids] if keys else [])

    def forced_step(self, lengths: Sequence[int], shape: Sequence[int], media: bool = False,
                    cache_keys: Sequence[CacheKey | None] = ()) -> Step:
        """The one forward that replays the group at `shape`, a built graph shape chosen by
        the caller (the start-up self-check's largest-bucket probe: short requests in the
        largest shape, padding after them). ValueError, saying why, where nothing would
        replay it: graphs off, a media request or a prefix-cache lookup (both run eagerly), or
        a shape not built or too small for the group."""
        rows, tokens = (int(value) for value in shape)
        if self.graphs is None:
            raise ValueError(f"cannot replay the {[rows, tokens]} shape: graphs are off "
                             "(every forward runs eagerly)")
        if media or any(key is not None for key in cache_keys):
            raise ValueError(f"cannot replay the {[rows, tokens]} shape: media requests and "
                             "prefix-cache lookups run eagerly")
        everyone = tuple(range(len(lengths)))
        if isinstance(self.graphs, PackedGraphRunner):
            if rows != 1:
                raise ValueError(f"a packed bucket is one row: [1, tokens], not "
                                 f"{[rows, tokens]}")
            return Step(everyone, (1, self.graphs.check_bucket(lengths, tokens)))
        return self.graphs.forced_step(lengths, (rows, tokens))

    def _padded_ids(self, ids: Sequence[Sequence[int]], lengths: list[int],
                    step: Step) -> Tensor:
        """The host ids of one padded forward: its requests right-padded to the step's shape
        (pad rows up to its rows), or to the longest of them for an eager forward."""
        rows, width = step.shape or (len(step.members),
                                     max(lengths[member] for member in step.members))
        out = torch.full((rows, width), self.pad_id, dtype=torch.long)
        for row, member in enumerate(step.members):
            out[row, :lengths[member]] = torch.tensor(ids[member], dtype=torch.long)
        return out

    # -- device half -------------------------------------------------------------------------

    def run_staged(self, staged: Staged, keep_hidden: bool = False) -> RunOutput:
        """One copy to the device, the forwards, the head; on the main thread."""
        clock = StageClock(self.device)
        clock.mark()
        with torch.inference_mode():
            moved = move_staged(staged.flat, staged.shapes, self.device)
            count = staged.forward_tensors
            width = len(staged.batch.tensors())
            batch = staged.batch.with_tensors(moved[count:count + width])
            reused = [0] * len(staged.lengths)
            plans = plan_group(self.prefix_cache, staged.cache_keys, staged.host_ids)
            if plans is not None:
                assert self.prefix_cache is not None
                real_ids = self._real_ids(staged, moved[:count])
                hidden = self._prefixed_hidden(staged, plans, real_ids)
                reused = plans.reused
            elif staged.packed:
                hidden, real_ids = self._packed_hidden(staged, moved[:count])
            else:
                hidden, real_ids = self._padded_hidden(staged, moved[:count])
            clock.mark()
            if staged.heads is None:
                slot = staged.slots[0] if staged.slots else BASE_SLOT
                outputs = self.heads[slot].forward_batch(
                    hidden, real_ids, self.backbone.lexical_table, batch)
            else:
                outputs = self._variant_heads(
                    staged.heads.with_tensors(moved[count + width:]), hidden, real_ids)
            values = torch.cat([torch.stack([o.logits, o.probabilities]) for o in outputs],
                               dim=1).cpu()
            clock.mark()
        sizes = [len(staged.lengths)] * len(staged.lengths)
        for step in staged.steps if plans is None else ():  # the prefixed forward held them all
            for member in step.members:
                sizes[member] = len(step.members)
        forward_ms, head_ms = clock.spans_ms()
        results = [RowResult(logits.tolist(), probabilities.tolist(), size, tokens)
                   for (logits, probabilities), size, tokens in zip(
                       values.split(list(batch.option_counts), dim=1), sizes, reused,
                       strict=True)]
        return RunOutput(results, {"forward_ms": forward_ms, "head_ms": head_ms},
                         hidden if keep_hidden else None)

    def _prefixed_hidden(self, staged: Staged, plan: GroupPlan, real_ids: Tensor) -> Tensor:
        """A prefix-cache group's final hidden states end to end
        (clef_worker.serving.prefix.graphed:
        the packed buckets' replays where they fit, the eager prefixed forward for the rest)."""
        assert self.prefix_cache is not None
        graphs = self.graphs if isinstance(self.graphs, PackedGraphRunner) else None
        return prefixed_hidden(
            GroupRun(self.backbone, self.prefix_cache, plan, staged.lengths, real_ids,
                     staged.cache_keys, staged.host_ids,
                     staged.slots or [BASE_SLOT] * len(staged.lengths), staged.media is not None,
                     lambda spans, members: self._selected(staged, spans, members),
                     self._media_inputs(staged)),
            graphs, self.prefix_paths)

    def _variant_heads(self, heads: VariantHeads, hidden: Tensor, real_ids: Tensor
                       ) -> list[HeadOutput]:
        """A mixed group: each slot's head over its own members' rows; outputs in request
        order."""
        outputs: dict[int, HeadOutput] = {}
        for slot, members, rows, batch in heads.groups:
            part = self.heads[slot].forward_batch(hidden.index_select(0, rows),
                                                  real_ids.index_select(0, rows),
                                                  self.backbone.lexical_table, batch)
            outputs.update(zip(members, part, strict=True))
        return [outputs[i] for i in range(len(outputs))]

    def _selected(self, staged: Staged, spans: Sequence[tuple[int, int]],
                  members: Sequence[int] | None = None, tokens: int | None = None) -> Any:
        """The adapter selection for one forward whose requests (`members`, default all) sit at
        `spans` of its flattened `tokens` (default: up to the last span's end); a no-op without
        variants."""
        if self.selection is None:
            return nullcontext()
        slots = staged.slots or [BASE_SLOT] * len(staged.lengths)
        chosen = [slots[m] for m in (members if members is not None else range(len(slots)))]
        return self.selection.using(chosen, spans, self.device, tokens)

    def _media_inputs(self, staged: Staged) -> Callable[[Tensor], MediaInputs] | None:
        """A media group's inputs for the prefixed forward (None: a text group)."""
        media, vision = staged.media, self.vision
        if media is None or vision is None:
            return None
        return lambda ids: MediaInputs(*vision.inputs(self.backbone, ids, media))

    def _real_ids(self, staged: Staged, moved: list[Tensor]) -> Tensor:
        """The group's real token ids end to end, on the device, whatever the layout staged."""
        if staged.bucket is not None:
            row, real_rows = moved[0], moved[1]
            return row.index_select(0, real_rows)
        return moved[0] if staged.packed else moved[-1]

    def _packed_hidden(self, staged: Staged, moved: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The real tokens' hidden states [sum T, H] end to end, and their ids."""
        if staged.bucket is not None:
            assert isinstance(self.graphs, PackedGraphRunner)
            row, real_rows, *slots = moved
            if slots:  # fine-tuned variants: the bucket's per-position slots
                hidden = self.graphs.run(row, staged.lengths, staged.bucket, slots[0])
            else:
                hidden = self.graphs.run(row, staged.lengths, staged.bucket)
            # Each request's rows from its aligned offset: one gather, also a copy out of the
            # static buffer the next replay overwrites.
            return hidden.index_select(0, real_rows), row.index_select(0, real_rows)
        [ids] = moved
        layout = PackedLayout.from_lengths(staged.lengths, self.device)
        with self._selected(staged, _end_to_end(staged.lengths)):
            return self.backbone.packed_hidden_state(ids, layout), ids

    def _padded_hidden(self, staged: Staged, moved: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Every request's real rows of the last hidden state, end to end, and their ids. A
        replay's output is a static buffer the next replay overwrites, so with more than one
        step each step's rows are copied out before the next runs."""
        *forward, real_ids = moved
        lengths, steps = staged.lengths, staged.steps
        per_step = 2 if staged.step_slots else 1
        device_ids = forward[::per_step]
        step_slots: list[Tensor | None] = (list(forward[1::2]) if staged.step_slots
                                           else [None] * len(steps))
        if staged.media is not None and self.vision is not None:
            with self._selected(staged, [(0, lengths[0])]):
                return self.vision.hidden_states(self.backbone, device_ids[0][0, :lengths[0]],
                                                 staged.media), real_ids
        rows: list[Tensor | None] = [None] * len(lengths)
        for step, ids, slots in zip(steps, device_ids, step_slots, strict=True):
            width = int(ids.shape[1])
            spans = [(row * width, (row + 1) * width) for row in range(len(step.members))]
            # `ids` holds the forward's every row (a shape's pad rows included), so the
            # selection covers all its tokens; a replay copies `slots` into its own buffer.
            with self._selected(staged, spans, step.members, ids.numel()):
                if isinstance(self.graphs, GraphRunner):
                    hidden = self.graphs.run(ids, step.shape, slots)
                else:
                    hidden = self.backbone.last_hidden_state(ids)
            for row, member in enumerate(step.members):
                part = hidden[row, :lengths[member]]
                rows[member] = part.clone() if len(steps) > 1 else part
        done = [row for row in rows if row is not None]
        assert len(done) == len(rows)
        return (done[0] if len(done) == 1 else torch.cat(done)), real_ids


def _end_to_end(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Where each request's tokens sit when they are laid end to end."""
    spans, start = [], 0
    for length in lengths:
        spans.append((start, start + length))
        start += length
    return spans


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

"""The joint schema head (spec §4) as torch modules, batched over every question and option.

Parameter names are the release's tensor names (`joint_head.safetensors` loads with
`strict=True`). All questions and all options are processed together: span means are segment
reductions over gathered tokens, the per-question softmaxes run on a padded `[questions, max
options]` grid, and evidence routing is one attention call with every option as a query. So a
64-question, 255-option request costs a handful of kernels more than a 1-question one, not 64
times as many.

Several records (a micro-batch) go through one pass the same way (`forward_batch`): their
tokens, questions and options are laid end to end for everything that works per token, question
or option, and only the attention steps (options and questions attending to their own record's
memory, questions to each other) see a padded `[records, longest, W]` layout with key padding
masks. A batch of eight then costs about what one record costs in kernel launches and Python,
which is most of the head's time on CPU and all of it on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from clef_worker.model.encoding import TYPE_IDS

LOG_100 = math.log(100.0)
LAYER_NORM_EPS = 1e-5
NORMALIZE_EPS = 1e-12
COSINE_EPS = 1e-8


@dataclass(frozen=True)
class HeadConfig:
    """`joint_head_config.json`: the head's constructor arguments."""

    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int

    @classmethod
    def from_file(cls, path: Path) -> HeadConfig:
        """Parse and sanity-check the config; ValueError names the offending key."""
        raw = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ValueError("is not a JSON object")
        values: dict[str, int] = {}
        for key in ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward"):
            value = raw.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
            values[key] = value
        if raw.get("dropout", 0) not in (0, 0.0):
            raise ValueError(f"dropout must be absent or 0, got {raw['dropout']!r}")
        config = cls(**values)
        if config.width % config.heads:
            raise ValueError(f"width {config.width} is not divisible by heads {config.heads}")
        return config


class EvidenceLayer(nn.Module):
    """Options attend to every memory token (never to each other), then a feed-forward step."""

    def __init__(self, width: int, heads: int, feedforward: int):
        super().__init__()
        self.query_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.memory_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.feedforward_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(feedforward, width),
            nn.Dropout(0.0),
        )

    def forward(self, queries: Tensor, memory: Tensor, memory_padding: Tensor | None = None
                ) -> Tensor:
        """queries [B, O, W], memory [B, T, W] (padding: [B, T], True where padded) -> [B, O,
        W]."""
        keys = self.memory_norm(memory)
        attended, _ = self.attention(self.query_norm(queries), keys, keys, need_weights=False,
                                     key_padding_mask=memory_padding)
        queries = queries + attended
        return queries + self.feedforward(self.feedforward_norm(queries))


@dataclass(frozen=True)
class HeadIndex:
    """Index tensors describing one record's questions and options, built once per request.

    Everything the head gathers or reduces is precomputed here on the host from the spans, so
    the device never has to synchronise to learn a size. Options are numbered in question order,
    then encode order.
    """

    question_types: Tensor  # [Q] 0 noul, 1 choice, 2 score
    question_tokens: Tensor  # [Nq] positions of every question-span token, span after span
    question_lengths: Tensor  # [Q]
    option_tokens: Tensor  # [No] positions of every option-span token, span after span
    option_lengths: Tensor  # [O]
    option_question: Tensor  # [O] which question each option belongs to
    grid: Tensor  # [Q, S] option number at each (question, slot); O where the slot is empty
    option_slot: Tensor  # [O] flat index into the [Q, S] grid

    @property
    def questions(self) -> int:
        return self.question_types.shape[0]

    @property
    def options(self) -> int:
        return self.option_question.shape[0]

    @classmethod
    def build(
        cls,
        question_spans: Sequence[tuple[int, int]],
        option_spans: Sequence[Sequence[tuple[int, int]]],
        question_types: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> HeadIndex:
        """From per-question spans (half-open) and type ids; every span must be non-empty."""
        counts = [len(spans) for spans in option_spans]
        if len(question_spans) != len(counts) or len(question_types) != len(counts):
            raise ValueError("question spans, option spans and types disagree in length")
        if not counts or min(counts) < 1:
            raise ValueError("every question needs at least one option")
        flat_options = [span for spans in option_spans for span in spans]
        q_positions, q_lengths = _positions(question_spans)
        o_positions, o_lengths = _positions(flat_options)
        slots = max(counts)
        option_count = len(flat_options)
        option_question = torch.repeat_interleave(
            torch.arange(len(counts)), torch.tensor(counts), output_size=option_count
        )
        starts = torch.tensor([0, *counts[:-1]]).cumsum(0)
        slot_in_question = torch.arange(option_count) - starts[option_question]
        option_slot = option_question * slots + slot_in_question
        grid = torch.full((len(counts) * slots,), option_count, dtype=torch.long)
        grid[option_slot] = torch.arange(option_count)
        grid = grid.view(len(counts), slots)
        tensors = {
            "question_types": torch.tensor(question_types, dtype=torch.long),
            "question_tokens": q_positions,
            "question_lengths": q_lengths,
            "option_tokens": o_positions,
            "option_lengths": o_lengths,
            "option_question": option_question,
            "grid": grid,
            "option_slot": option_slot,
        }
        return cls(**{name: t.to(device, non_blocking=True) for name, t in tensors.items()})


@dataclass(frozen=True)
class RecordSpans:
    """One record's part of a batch: its token count and its questions' spans (half-open,
    relative to the record's first token) and type ids."""

    tokens: int
    question_spans: Sequence[tuple[int, int]]
    option_spans: Sequence[Sequence[tuple[int, int]]]
    question_types: Sequence[int]


@dataclass(frozen=True)
class HeadBatch:
    """Where every record's tokens, questions and options sit in one head pass.

    `index` describes all records' questions and options over their tokens laid end to end
    (record after record), so everything per token, question or option runs on flat tensors.
    The `*_rows` tensors lay the flat rows out as `[records, longest]` for the attention steps;
    a padded slot holds the row count itself (an extra zero row is appended before gathering),
    which is also how the padding masks are derived on the device. The `*_place` tensors are
    the inverse: each flat row's position in the flattened padded layout.
    """

    index: HeadIndex
    final_tokens: Tensor  # [B] each record's last token (the final ':')
    question_record: Tensor  # [Q] the record of each question
    memory_rows: Tensor  # [B, T_max]
    option_rows: Tensor  # [B, O_max]
    question_rows: Tensor  # [B, Q_max]
    option_place: Tensor  # [O]
    question_place: Tensor  # [Q]
    option_counts: tuple[int, ...]  # host-side: options per record, to split the results

    TENSORS = ("final_tokens", "question_record", "memory_rows", "option_rows",
               "question_rows", "option_place", "question_place")

    @property
    def records(self) -> int:
        return len(self.option_counts)

    @classmethod
    def build(cls, records: Sequence[RecordSpans]) -> HeadBatch:
        """Lay the records end to end (on the host); spans must be valid for `HeadIndex`."""
        starts = [0]
        for record in records[:-1]:
            starts.append(starts[-1] + record.tokens)
        index = HeadIndex.build(
            [(a + start, b + start) for record, start in zip(records, starts, strict=True)
             for a, b in record.question_spans],
            [[(a + start, b + start) for a, b in spans]
             for record, start in zip(records, starts, strict=True)
             for spans in record.option_spans],
            [t for record in records for t in record.question_types],
        )
        question_counts = [len(record.question_spans) for record in records]
        option_counts = [sum(len(spans) for spans in record.option_spans) for record in records]
        memory_rows, _ = _padded_layout([record.tokens for record in records])
        option_rows, option_place = _padded_layout(option_counts)
        question_rows, question_place = _padded_layout(question_counts)
        return cls(
            index=index,
            final_tokens=torch.tensor([start + record.tokens - 1
                                       for record, start in zip(records, starts, strict=True)]),
            question_record=torch.repeat_interleave(torch.arange(len(records)),
                                                    torch.tensor(question_counts)),
            memory_rows=memory_rows, option_rows=option_rows, question_rows=question_rows,
            option_place=option_place, question_place=question_place,
            option_counts=tuple(option_counts),
        )

    @classmethod
    def of_one(cls, index: HeadIndex, tokens: int) -> HeadBatch:
        """One record already indexed (on the index's device): every layout is the identity."""
        device = index.grid.device
        return cls(
            index=index, final_tokens=torch.tensor([tokens - 1], device=device),
            question_record=torch.zeros(index.questions, dtype=torch.long, device=device),
            memory_rows=torch.arange(tokens, device=device).unsqueeze(0),
            option_rows=torch.arange(index.options, device=device).unsqueeze(0),
            question_rows=torch.arange(index.questions, device=device).unsqueeze(0),
            option_place=torch.arange(index.options, device=device),
            question_place=torch.arange(index.questions, device=device),
            option_counts=(index.options,),
        )

    def tensors(self) -> list[Tensor]:
        """Every index tensor, in a fixed order (for the packed host-to-device copy)."""
        return ([getattr(self.index, f.name) for f in dataclasses.fields(HeadIndex)]
                + [getattr(self, name) for name in self.TENSORS])

    def with_tensors(self, tensors: Sequence[Tensor]) -> HeadBatch:
        """The same batch with its tensors replaced (in `tensors()` order), e.g. moved."""
        names = [f.name for f in dataclasses.fields(HeadIndex)]
        index = HeadIndex(**dict(zip(names, tensors[:len(names)], strict=True)))
        rest = dict(zip(self.TENSORS, tensors[len(names):], strict=True))
        return HeadBatch(index=index, option_counts=self.option_counts, **rest)


def _padded_layout(counts: Sequence[int]) -> tuple[Tensor, Tensor]:
    """For groups of `counts` consecutive rows: a [groups, max] table of row numbers (the total
    row count where padded) and each row's index in that table flattened."""
    longest = max(counts)
    total = sum(counts)
    table = torch.full((len(counts), longest), total, dtype=torch.long)
    place = torch.empty(total, dtype=torch.long)
    first = 0
    for group, count in enumerate(counts):
        table[group, :count] = torch.arange(first, first + count)
        place[first:first + count] = torch.arange(count) + group * longest
        first += count
    return table, place


def _laid_out(rows: Tensor, table: Tensor, batch: HeadBatch) -> Tensor:
    """Flat rows [N, W] as [records, longest, W], zeros where padded (one record: a view)."""
    if batch.records == 1:
        return rows.unsqueeze(0)
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    return padded.index_select(0, table.flatten()).view(*table.shape, rows.shape[-1])


def _flattened(laid_out: Tensor, place: Tensor, batch: HeadBatch) -> Tensor:
    """The inverse of `_laid_out`: [records, longest, W] back to the flat rows [N, W]."""
    if batch.records == 1:
        return laid_out.squeeze(0)
    return laid_out.flatten(0, 1).index_select(0, place)


def _padding(table: Tensor, rows: int, batch: HeadBatch) -> Tensor | None:
    """The key padding mask of a layout (True where padded); None for one record."""
    return None if batch.records == 1 else table == rows


def _positions(spans: Sequence[tuple[int, int]]) -> tuple[Tensor, Tensor]:
    """All token positions covered by the spans (in span order) and each span's length."""
    bounds = torch.tensor(spans, dtype=torch.long).view(-1, 2)
    lengths = bounds[:, 1] - bounds[:, 0]
    if bool((lengths <= 0).any()):
        raise ValueError("empty span")
    total = int(lengths.sum())
    span_of_token = torch.repeat_interleave(
        torch.arange(len(spans)), lengths, output_size=total
    )
    first_token = lengths.cumsum(0) - lengths
    positions = bounds[span_of_token, 0] + torch.arange(total) - first_token[span_of_token]
    return positions, lengths


def span_means(values: Tensor, tokens: Tensor, lengths: Tensor) -> Tensor:
    """Mean of `values[tokens]` over consecutive segments of `lengths`, accumulated in float32
    (float64 for float64 values, so a float64 head is float64 throughout).

    A segmented reduction over the gathered rows: deterministic (no atomics), exact float32
    accumulation even when `values` is bf16, and independent of how many segments there are.
    """
    gathered = values.index_select(0, tokens).to(torch.promote_types(values.dtype, torch.float32))
    sums = torch.segment_reduce(gathered, "sum", lengths=lengths, axis=0, unsafe=True)
    return (sums / lengths.unsqueeze(1)).to(values.dtype)


@dataclass(frozen=True)
class HeadOutput:
    """Per-option results in question order then encode order (float32)."""

    logits: Tensor  # [O]
    probabilities: Tensor  # [O]


class JointSchemaHead(nn.Module):
    """Spec §4: scores every option of every question of one record."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        hidden, width = config.hidden_size, config.width
        self.config = config
        self.hidden_norm = nn.LayerNorm(hidden, eps=LAYER_NORM_EPS)
        self.memory_projection = nn.Linear(hidden, width, bias=False)
        self.question_projection = nn.Linear(hidden, width, bias=False)
        self.option_question_projection = nn.Linear(hidden, width, bias=False)
        self.global_projection = nn.Linear(hidden, width, bias=False)
        self.option_context_projection = nn.Linear(hidden, width, bias=False)
        self.option_lexical_projection = nn.Linear(hidden, width, bias=False)
        self.type_embedding = nn.Embedding(len(TYPE_IDS), width)
        self.evidence_layers = nn.ModuleList(
            EvidenceLayer(width, config.heads, config.feedforward)
            for _ in range(config.routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.field_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.option_norm = nn.LayerNorm(width, eps=LAYER_NORM_EPS)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=width,
                nhead=config.heads,
                dim_feedforward=config.feedforward,
                dropout=0.0,
                activation="gelu",
                layer_norm_eps=LAYER_NORM_EPS,
                batch_first=True,
                norm_first=True,
            )
            for _ in range(config.layers)
        )
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(width, 1),
        )
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))

    def forward(
        self, hidden: Tensor, input_ids: Tensor, lexical_table: Tensor, index: HeadIndex
    ) -> HeadOutput:
        """One record: hidden [T, H] (backbone last hidden state), input_ids [T],
        lexical_table [vocab, H]."""
        batch = HeadBatch.of_one(index, tokens=hidden.shape[0])
        return self.forward_batch(hidden, input_ids, lexical_table, batch)[0]

    def forward_batch(
        self, hidden: Tensor, input_ids: Tensor, lexical_table: Tensor, batch: HeadBatch
    ) -> list[HeadOutput]:
        """Several records at once: hidden [sum T, H] and input_ids [sum T] hold the records'
        real tokens end to end, as `batch` describes them; one output per record."""
        dtype = self.hidden_norm.weight.dtype
        index = batch.index
        h = self.hidden_norm(hidden.to(dtype))
        memory = _laid_out(self.memory_projection(h), batch.memory_rows, batch)  # [B, T, W]
        memory_padding = _padding(batch.memory_rows, h.shape[0], batch)
        final = h.index_select(0, batch.final_tokens)  # g: each record's final ':' token
        final_of_question = final.index_select(0, batch.question_record)  # [Q, H]
        questions = span_means(h, index.question_tokens, index.question_lengths)  # [Q, H]
        contexts = span_means(h, index.option_tokens, index.option_lengths)  # [O, H]
        lexical = span_means(
            lexical_table,
            input_ids.index_select(0, index.option_tokens),
            index.option_lengths,
        ).to(dtype)  # l: [O, H], mean of the raw lm_head rows of each option span's tokens

        option_question = index.option_question
        queries = _laid_out(
            self.option_context_projection(contexts)
            + self.option_lexical_projection(lexical)
            + self.option_question_projection(questions).index_select(0, option_question),
            batch.option_rows, batch)
        for layer in self.evidence_layers:
            queries = layer(queries, memory, memory_padding)
        routed = _flattened(queries, batch.option_place, batch)  # r: [O, W]

        bases = self.question_projection(questions)  # b: [Q, W]
        affinity = (routed * bases.index_select(0, option_question)).sum(-1)
        weights = _grid_softmax(affinity / math.sqrt(self.config.width), index)  # [Q, S]
        padded = torch.cat([routed, routed.new_zeros(1, routed.shape[1])]).index_select(
            0, index.grid.flatten()
        ).view(*index.grid.shape, -1)  # [Q, S, W], zero rows in empty slots
        summary = torch.einsum("qs,qsw->qw", weights.to(routed.dtype), padded)
        fields = _laid_out(
            bases
            + self.option_summary_norm(summary)
            + self.global_projection(final_of_question)
            + self.type_embedding(index.question_types),
            batch.question_rows, batch)
        question_padding = _padding(batch.question_rows, index.questions, batch)
        for decoder_layer in self.layers:
            fields = decoder_layer(fields, memory, tgt_key_padding_mask=question_padding,
                                   memory_key_padding_mask=memory_padding)
        fields = self.field_norm(_flattened(fields, batch.question_place, batch))  # F: [Q, W]

        anchors = F.normalize(questions + final_of_question, dim=-1, eps=NORMALIZE_EPS)
        prior = (
            F.normalize(lexical, dim=-1, eps=NORMALIZE_EPS)
            * anchors.index_select(0, option_question)
        ).sum(-1) * self.prior_logit_scale.clamp(max=LOG_100).exp()
        option_fields = fields.index_select(0, option_question)  # [O, W]
        values = self.option_norm(routed)
        cosine = F.cosine_similarity(option_fields, values, dim=-1, eps=COSINE_EPS)
        residual = self.residual_scorer(
            torch.cat(
                [option_fields, values, option_fields * values, (option_fields - values).abs()],
                dim=-1,
            )
        ).squeeze(-1)
        joint = self.joint_logit_scale.clamp(max=LOG_100).exp() * cosine + residual
        logits = (prior + torch.sigmoid(self.residual_gate) * joint).float()
        probabilities = _grid_softmax(logits, index).flatten().index_select(0, index.option_slot)
        return [HeadOutput(logits=logit, probabilities=probability) for logit, probability in
                zip(logits.split(batch.option_counts), probabilities.split(batch.option_counts),
                    strict=True)]


def _grid_softmax(scores: Tensor, index: HeadIndex) -> Tensor:
    """Softmax of per-option scores within each question, as a [Q, S] grid (0 in empty slots)."""
    grid = scores.new_full((index.grid.numel(),), float("-inf"))
    grid = grid.index_put((index.option_slot,), scores).view(index.grid.shape)
    return torch.softmax(grid, dim=-1)

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

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from clef_worker.model.encoding import TYPE_IDS
from clef_worker.model.head_batch import HeadBatch, HeadIndex

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

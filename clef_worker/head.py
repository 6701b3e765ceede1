"""The joint schema head (spec §4) as torch modules, batched over every question and option.

Parameter names are the release's tensor names (`joint_head.safetensors` loads with
`strict=True`). One record is scored at a time; within it, all questions and all options are
processed together: span means are segment reductions over gathered tokens, the per-question
softmaxes run on a padded `[questions, max options]` grid, and evidence routing is one attention
call with every option as a query. So a 64-question, 255-option request costs a handful of
kernels more than a 1-question one, not 64 times as many.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

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

    def forward(self, queries: Tensor, memory: Tensor) -> Tensor:
        """queries [1, O, W], memory [1, T, W] -> [1, O, W]."""
        keys = self.memory_norm(memory)
        attended, _ = self.attention(self.query_norm(queries), keys, keys, need_weights=False)
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
    """Mean of `values[tokens]` over consecutive segments of `lengths`, accumulated in float32.

    A segmented reduction over the gathered rows: deterministic (no atomics), exact float32
    accumulation even when `values` is bf16, and independent of how many segments there are.
    """
    gathered = values.index_select(0, tokens).float()
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
        self.type_embedding = nn.Embedding(3, width)
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
        """hidden [T, H] (backbone last hidden state), input_ids [T], lexical_table [vocab, H]."""
        dtype = self.hidden_norm.weight.dtype
        h = self.hidden_norm(hidden.to(dtype))
        memory = self.memory_projection(h).unsqueeze(0)  # [1, T, W]
        final = h[-1]  # g: the final ':' token
        questions = span_means(h, index.question_tokens, index.question_lengths)  # [Q, H]
        contexts = span_means(h, index.option_tokens, index.option_lengths)  # [O, H]
        lexical = span_means(
            lexical_table,
            input_ids.index_select(0, index.option_tokens),
            index.option_lengths,
        ).to(dtype)  # l: [O, H], mean of the raw lm_head rows of each option span's tokens

        option_question = index.option_question
        queries = (
            self.option_context_projection(contexts)
            + self.option_lexical_projection(lexical)
            + self.option_question_projection(questions).index_select(0, option_question)
        ).unsqueeze(0)
        for layer in self.evidence_layers:
            queries = layer(queries, memory)
        routed = queries.squeeze(0)  # r: [O, W]

        bases = self.question_projection(questions)  # b: [Q, W]
        affinity = (routed * bases.index_select(0, option_question)).sum(-1)
        weights = _grid_softmax(affinity / math.sqrt(self.config.width), index)  # [Q, S]
        padded = torch.cat([routed, routed.new_zeros(1, routed.shape[1])]).index_select(
            0, index.grid.flatten()
        ).view(*index.grid.shape, -1)  # [Q, S, W], zero rows in empty slots
        summary = torch.einsum("qs,qsw->qw", weights.to(routed.dtype), padded)
        fields = (
            bases
            + self.option_summary_norm(summary)
            + self.global_projection(final).unsqueeze(0)
            + self.type_embedding(index.question_types)
        ).unsqueeze(0)
        for decoder_layer in self.layers:
            fields = decoder_layer(fields, memory)
        fields = self.field_norm(fields.squeeze(0))  # F: [Q, W]

        anchors = F.normalize(questions + final.unsqueeze(0), dim=-1, eps=NORMALIZE_EPS)
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
        return HeadOutput(logits=logits, probabilities=probabilities)


def _grid_softmax(scores: Tensor, index: HeadIndex) -> Tensor:
    """Softmax of per-option scores within each question, as a [Q, S] grid (0 in empty slots)."""
    grid = scores.new_full((index.grid.numel(),), float("-inf"))
    grid = grid.index_put((index.option_slot,), scores).view(index.grid.shape)
    return torch.softmax(grid, dim=-1)

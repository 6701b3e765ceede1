"""The batched joint head against a straightforward per-question, per-option computation of
spec §4.2, for random shapes and random weights (float64, so only the indexing can differ), and
what batching buys: the head's torch work does not grow with questions, options or records."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from clef_worker.model.head import EvidenceLayer, HeadConfig, JointSchemaHead
from clef_worker.model.head_batch import HeadBatch, HeadIndex, RecordSpans

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23


def randomised_head(config: HeadConfig, seed: int) -> JointSchemaHead:
    """A head whose every parameter (LayerNorm affines and the clamped scalars included) is
    random, so no term can hide behind an identity initialisation."""
    generator = torch.Generator().manual_seed(seed)
    head = JointSchemaHead(config).double().eval()
    touched: set[str] = set()
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if parameter.dim() == 0:
                # Straddle ln(100) ~ 4.6 so the clamp is exercised.
                value = torch.rand((), generator=generator, dtype=torch.float64) * 7 - 1
                parameter.copy_(value)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator,
                                            dtype=torch.float64) * 0.5)
            touched.add(name)
    # Every tensor the head loads was randomised, and none kept an identity value (all 0 or 1).
    assert touched == set(head.state_dict())
    for name, parameter in head.named_parameters():
        assert not bool(torch.all(parameter == 0)) and not bool(torch.all(parameter == 1)), name
    return head


def reference_logits(
    head: JointSchemaHead,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    question_spans: list[tuple[int, int]],
    option_spans: list[list[tuple[int, int]]],
    types: list[int],
) -> tuple[list[float], list[float]]:
    """Spec §4.2 written as loops over questions and options."""
    width = head.config.width
    h = head.hidden_norm(hidden)
    memory = head.memory_projection(h)
    final = h[-1]
    questions = [h[s:e].mean(0) for s, e in question_spans]
    routed: list[list[torch.Tensor]] = []
    lexical: list[list[torch.Tensor]] = []
    for k, spans in enumerate(option_spans):
        routed.append([])
        lexical.append([])
        for s, e in spans:
            context = h[s:e].mean(0)
            lex = table[ids[s:e]].mean(0)
            u = (head.option_context_projection(context) + head.option_lexical_projection(lex)
                 + head.option_question_projection(questions[k]))
            for layer in head.evidence_layers:
                assert isinstance(layer, EvidenceLayer)
                keys = layer.memory_norm(memory).unsqueeze(0)
                query = layer.query_norm(u).view(1, 1, -1)
                attended = layer.attention(query, keys, keys, need_weights=False)[0]
                u = u + attended.view(-1)
                u = u + layer.feedforward(layer.feedforward_norm(u))
            routed[k].append(u)
            lexical[k].append(lex)
    fields = []
    for k in range(len(question_spans)):
        base = head.question_projection(questions[k])
        scores = torch.stack([(r * base).sum() / math.sqrt(width) for r in routed[k]])
        weights = torch.softmax(scores, 0)
        summary = sum(w * r for w, r in zip(weights, routed[k], strict=True))
        fields.append(base + head.option_summary_norm(summary) + head.global_projection(final)
                      + head.type_embedding.weight[types[k]])
    x = torch.stack(fields).unsqueeze(0)
    for layer in head.layers:
        x = layer(x, memory.unsqueeze(0))
    field_vectors = head.field_norm(x.squeeze(0))
    prior_scale = math.exp(min(head.prior_logit_scale.item(), math.log(100)))
    joint_scale = math.exp(min(head.joint_logit_scale.item(), math.log(100)))
    gate = 1 / (1 + math.exp(-head.residual_gate.item()))
    logits: list[float] = []
    probabilities: list[float] = []
    for k in range(len(question_spans)):
        anchor = F.normalize(questions[k] + final, dim=0, eps=1e-12)
        fk = field_vectors[k]
        row = []
        for r, lex in zip(routed[k], lexical[k], strict=True):
            prior = prior_scale * (F.normalize(lex, dim=0, eps=1e-12) * anchor).sum()
            v = head.option_norm(r)
            cosine = F.cosine_similarity(fk, v, dim=0, eps=1e-8)
            residual = head.residual_scorer(torch.cat([fk, v, fk * v, (fk - v).abs()]))[0]
            row.append(prior + gate * (joint_scale * cosine + residual))
        stacked = torch.stack(row)
        logits += stacked.tolist()
        probabilities += torch.softmax(stacked, 0).tolist()
    return logits, probabilities


@st.composite
def records(draw: st.DrawFn) -> dict:
    heads = draw(st.sampled_from([1, 2, 4]))
    config = HeadConfig(
        hidden_size=draw(st.sampled_from([4, 8, 12])),
        width=heads * draw(st.sampled_from([2, 4])),
        routing_layers=draw(st.integers(0, 2)),
        layers=draw(st.integers(0, 2)),
        heads=heads,
        feedforward=draw(st.sampled_from([4, 8])),
    )
    counts = draw(st.lists(st.integers(1, 5), min_size=1, max_size=5))
    cursor = draw(st.integers(0, 3))
    question_spans, option_spans = [], []
    for count in counts:
        length = draw(st.integers(1, 4))
        question_spans.append((cursor, cursor + length))
        cursor += length + draw(st.integers(0, 3))
        spans = []
        for _ in range(count):
            length = draw(st.integers(1, 4))
            spans.append((cursor, cursor + length))
            cursor += length + draw(st.integers(0, 2))
        option_spans.append(spans)
    return {
        "config": config,
        "tokens": cursor + 1 + draw(st.integers(0, 3)),
        "question_spans": question_spans,
        "option_spans": option_spans,
        "types": [draw(st.integers(0, 2)) for _ in counts],
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_batched_head_equals_loop(record: dict) -> None:
    config: HeadConfig = record["config"]
    head = randomised_head(config, record["seed"])
    generator = torch.Generator().manual_seed(record["seed"] + 1)
    vocab = 17
    hidden = torch.randn(record["tokens"], config.hidden_size, generator=generator,
                         dtype=torch.float64)
    ids = torch.randint(0, vocab, (record["tokens"],), generator=generator)
    table = torch.randn(vocab, config.hidden_size, generator=generator, dtype=torch.float64)
    index = HeadIndex.build(record["question_spans"], record["option_spans"], record["types"])
    with torch.inference_mode():
        output = head(hidden, ids, table, index)
        want_logits, want_probabilities = reference_logits(
            head, hidden, ids, table, record["question_spans"], record["option_spans"],
            record["types"],
        )
    assert output.logits.dtype == torch.float32  # the head hands back float32, like the release
    # The head runs in float64 here (its span means too) and rounds its logits to float32 at the
    # end: apart from float64 summation order (around 1e-13 at these magnitudes) that rounding,
    # at most half a float32 ulp (2**-24 relative), is the whole difference from the loop.
    assert output.logits.tolist() == pytest.approx(want_logits, rel=FLOAT32_EPS, abs=1e-9)
    # The softmax runs on the float32 logits: each logit's rounding (up to FLOAT32_EPS / 2 times
    # the largest logit) moves a probability by at most twice that, plus the softmax's own
    # float32 arithmetic (a few FLOAT32_EPS).
    scale = max(abs(value) for value in want_logits)
    assert output.probabilities.tolist() == pytest.approx(
        want_probabilities, rel=0, abs=FLOAT32_EPS * (scale + 8))


def test_index_layout() -> None:
    index = HeadIndex.build([(0, 2), (9, 10)], [[(3, 5), (6, 7)], [(11, 14)]], [1, 0])
    assert index.question_tokens.tolist() == [0, 1, 9]
    assert index.question_lengths.tolist() == [2, 1]
    assert index.option_tokens.tolist() == [3, 4, 6, 11, 12, 13]
    assert index.option_lengths.tolist() == [2, 1, 3]
    assert index.option_question.tolist() == [0, 0, 1]
    assert index.grid.tolist() == [[0, 1], [2, 3]]  # 3 = the empty slot
    assert (index.grid < index.options).tolist() == [[True, True], [True, False]]
    assert index.option_slot.tolist() == [0, 1, 2]


@pytest.mark.parametrize("spans", [[(3, 3)], []])
def test_index_refuses_empty_spans_and_optionless_questions(spans: list) -> None:
    with pytest.raises(ValueError):
        HeadIndex.build([(0, 2)], [spans], [1])


class TorchCalls(TorchFunctionMode):
    """Counts every torch function and tensor method called while active: module calls, and
    also the functional, indexing and reduction calls a per-question or per-option Python loop
    would make, which forward hooks would not see."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def small_head() -> JointSchemaHead:
    config = HeadConfig(hidden_size=8, width=8, routing_layers=2, layers=2, heads=2,
                        feedforward=8)
    return randomised_head(config, 0).float()


def spread_spans(questions: int, options: int) -> tuple[list[tuple[int, int]],
                                                         list[list[tuple[int, int]]]]:
    """Spans over 64 tokens (spans may share tokens: the index does not require them disjoint)."""
    return ([(q % 60, q % 60 + 2) for q in range(questions)],
            [[(j % 60, j % 60 + 3) for j in range(options)] for _ in range(questions)])


def test_many_questions_cost_one_pass() -> None:
    """64 questions x 255 options make exactly the torch calls of one question with one
    option; the per-question loop of the spec (`reference_logits`) makes more with every
    question, which is what this measure would catch if the batching went."""
    head = small_head()
    tokens = 64
    hidden = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(tokens, dtype=torch.long)
    table = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))

    def batched(questions: int, options: int) -> int:
        question_spans, option_spans = spread_spans(questions, options)
        index = HeadIndex.build(question_spans, option_spans, [1] * questions)
        with torch.inference_mode(), TorchCalls() as calls:
            head(hidden, ids, table, index)
        return calls.count

    def looped(questions: int, options: int) -> int:
        question_spans, option_spans = spread_spans(questions, options)
        with torch.inference_mode(), TorchCalls() as calls:
            reference_logits(head, hidden, ids, table, question_spans, option_spans,
                             [1] * questions)
        return calls.count

    assert batched(64, 255) == batched(1, 1)
    assert looped(2, 1) > looped(1, 1) and looped(1, 2) > looped(1, 1)


@st.composite
def batches(draw: st.DrawFn) -> tuple[HeadConfig, int, list[dict]]:
    """One head config and 1-5 records of different token, question and option counts."""
    first = draw(records())
    more = draw(st.lists(records(), min_size=0, max_size=4))
    return first["config"], first["seed"], [first, *more]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_one_pass_over_several_records_equals_each_alone(batch: tuple) -> None:
    """forward_batch (records end to end, attention on a padded layout with key padding masks)
    gives every record the logits and probabilities it gets alone."""
    config, seed, drawn = batch
    head = randomised_head(config, seed).float()
    generator = torch.Generator().manual_seed(seed + 2)
    vocab = 17
    table = torch.randn(vocab, config.hidden_size, generator=generator)
    hiddens = [torch.randn(r["tokens"], config.hidden_size, generator=generator) for r in drawn]
    ids = [torch.randint(0, vocab, (r["tokens"],), generator=generator) for r in drawn]
    spans = [RecordSpans(r["tokens"], r["question_spans"], r["option_spans"], r["types"])
             for r in drawn]
    with torch.inference_mode():
        together = head.forward_batch(torch.cat(hiddens), torch.cat(ids), table,
                                      HeadBatch.build(spans))
        alone = [head(hidden, row_ids, table, HeadIndex.build(
            s.question_spans, s.option_spans, s.question_types))
            for hidden, row_ids, s in zip(hiddens, ids, spans, strict=True)]
    assert len(together) == len(drawn)
    for got, want in zip(together, alone, strict=True):
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.probabilities, want.probabilities, atol=1e-5, rtol=1e-5)


def test_batch_layout() -> None:
    """Two records of 3 and 2 tokens: spans shifted by the first record's length, and the
    padded tables hold the row count where a record is shorter."""
    batch = HeadBatch.build([
        RecordSpans(3, [(0, 1)], [[(1, 2), (2, 3)]], [1]),
        RecordSpans(2, [(0, 1)], [[(1, 2)]], [0]),
    ])
    assert batch.index.question_tokens.tolist() == [0, 3]
    assert batch.index.option_tokens.tolist() == [1, 2, 4]
    assert batch.final_tokens.tolist() == [2, 4]
    assert batch.question_record.tolist() == [0, 1]
    assert batch.memory_rows.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert batch.option_rows.tolist() == [[0, 1], [2, 3]]
    assert batch.option_place.tolist() == [0, 1, 2]
    assert batch.option_counts == (2, 1)
    moved = batch.with_tensors([t.clone() for t in batch.tensors()])
    assert moved.memory_rows.tolist() == batch.memory_rows.tolist()
    assert moved.index.grid.tolist() == batch.index.grid.tolist()


def test_a_batch_costs_the_torch_calls_of_two_records() -> None:
    """Eight records in one pass make exactly the torch calls of two (one record alone takes a
    shorter path: views instead of padded layouts, no masks); running the head once per record,
    as an unbatched server would, makes more with every record."""
    head = small_head()

    def inputs(records: int) -> tuple[list[RecordSpans], torch.Tensor, torch.Tensor]:
        spans = [RecordSpans(10 + r, [(0, 2)], [[(3, 5), (6, 8 + r % 2)]], [1])
                 for r in range(records)]
        tokens = sum(s.tokens for s in spans)
        return spans, torch.randn(tokens, 8), torch.zeros(tokens, dtype=torch.long)

    table = torch.randn(3, 8)

    def batched(records: int) -> int:
        spans, hidden, ids = inputs(records)
        batch = HeadBatch.build(spans)
        with torch.inference_mode(), TorchCalls() as calls:
            out = head.forward_batch(hidden, ids, table, batch)
        assert len(out) == records
        return calls.count

    def one_by_one(records: int) -> int:
        spans, hidden, ids = inputs(records)
        indexes = [HeadIndex.build(s.question_spans, s.option_spans, s.question_types)
                   for s in spans]
        starts = [sum(s.tokens for s in spans[:r]) for r in range(records)]
        with torch.inference_mode(), TorchCalls() as calls:
            for s, index, start in zip(spans, indexes, starts, strict=True):
                head(hidden[start:start + s.tokens], ids[start:start + s.tokens], table, index)
        return calls.count

    assert batched(8) == batched(2)
    assert one_by_one(2) > one_by_one(1)

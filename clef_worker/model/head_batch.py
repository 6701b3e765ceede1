"""The joint schema head's index tensors: which tokens, questions and options a record (or a
micro-batch of records) hands the head, built once per request on the host so the head's forward
is index arithmetic on the device (see `clef_worker.model.head`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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

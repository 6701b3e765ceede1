"""The warm-up request is chosen from the limits: the richest candidate the worker would accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import Encoder
from clef_worker.starting import warmup


@pytest.fixture(scope="module")
def encoder(tiny_snapshot: Path) -> Encoder:
    return Encoder.from_file(tiny_snapshot / "tokenizer.json")


def _choose(encoder: Encoder, limits: RequestLimits) -> dict | None:
    return warmup.choose(limits, lambda request: encoder.encode(request, limits.max_length))


def test_default_limits_take_the_representative_request(encoder: Encoder) -> None:
    assert _choose(encoder, RequestLimits()) == warmup.REPRESENTATIVE


@pytest.mark.parametrize("max_length", [150, 200, 420, 800])
def test_a_short_budget_takes_a_smaller_request_that_fits(encoder: Encoder,
                                                          max_length: int) -> None:
    limits = RequestLimits(max_length=max_length)
    chosen = _choose(encoder, limits)
    assert chosen is not None
    assert encoder.encode(chosen, max_length).length <= max_length
    # Richest first: no earlier candidate fits.
    for candidate in warmup.candidates(limits):
        if candidate == chosen:
            break
        with pytest.raises(ValueError, match="schema requires"):
            encoder.encode(candidate, max_length)


def test_a_budget_below_any_schema_chooses_nothing(encoder: Encoder) -> None:
    assert _choose(encoder, RequestLimits(max_length=64)) is None


def test_candidates_respect_the_shape_limits(encoder: Encoder) -> None:
    limits = RequestLimits(max_questions=1, max_choice_options=1, max_score_levels=1)
    for candidate in warmup.candidates(limits):
        validate_request(candidate, limits)
        assert len(candidate["questions"]) == 1
    chosen = _choose(encoder, limits)
    assert chosen is not None and len(chosen["questions"]) == 1


def test_synthetic_encoding_fills_the_budget() -> None:
    encoding = warmup.synthetic_encoding([5, 6], 48)
    assert encoding is not None and encoding.length == 48
    assert encoding.input_ids[:4] == [5, 6, 5, 6]
    (question,) = encoding.questions
    assert all(end <= 48 for _, end in (question.question_span, *question.option_spans))
    assert warmup.synthetic_encoding([5], 2) is None

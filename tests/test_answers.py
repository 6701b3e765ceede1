"""Answer assembly (spec §5): orders, the choice tie rule, score arithmetic, rounding, usage and
the serialised body."""

from __future__ import annotations

import json

import pytest

from clef_worker.model.answers import answer_question, build_response, serialize
from clef_worker.model.encoding import TYPE_IDS, EncodedQuestion, Encoding


def _encoded(qid: str, kind: str, options: tuple[str, ...]) -> EncodedQuestion:
    return EncodedQuestion(id=qid, type=kind, type_id=TYPE_IDS[kind],
                           question_span=(0, 1), option_ids=options,
                           option_spans=tuple((i + 1, i + 2) for i in range(len(options))))


def test_noul_reports_p_true() -> None:
    answer = answer_question({"type": "noul"}, _encoded("q", "noul", ("true", "false")),
                             [0.123456, 0.876544])
    assert answer == {"type": "noul", "noul": 0.1235}


def test_choice_follows_caller_order_and_first_maximum() -> None:
    question = {"type": "choice", "criteria": {"b": "B", "a": "A", "c": "C"}}
    # encode order is sorted: a, b, c; a and b tie for the maximum
    answer = answer_question(question, _encoded("q", "choice", ("a", "b", "c")), [0.4, 0.4, 0.2])
    assert list(answer["probabilities"]) == ["b", "a", "c"]
    assert answer["choice"] == "b"  # first maximum in the caller's order, not the sorted one
    assert answer["confidence"] == 0.4


def test_choice_decides_on_unrounded_values() -> None:
    question = {"type": "choice", "criteria": {"x": 1, "y": 2}}
    answer = answer_question(question, _encoded("q", "choice", ("x", "y")),
                             [0.50004, 0.49996])
    assert answer["choice"] == "x"
    assert answer["probabilities"] == {"x": 0.5, "y": 0.5}


def test_score_expectation_confidence_and_legend() -> None:
    levels = ["none", {"label": "some"}, None]
    answer = answer_question({"type": "score", "criteria": levels},
                             _encoded("q", "score", ("0", "1", "2")), [0.2, 0.3, 0.5])
    assert answer == {
        "type": "score",
        "score": 1.3,
        "confidence": 0.5,
        "legend": {"0": "none", "1": {"label": "some"}, "2": None},
        "probabilities": {"0": 0.2, "1": 0.3, "2": 0.5},
    }


def test_response_order_model_and_usage() -> None:
    request = {
        "model": "Zoë-1 ",
        "state": "s",
        "questions": {
            "second": {"type": "noul"},
            "first": {"type": "choice", "criteria": {"k": None}},
        },
    }
    encoding = Encoding(
        input_ids=list(range(42)),
        questions=(_encoded("second", "noul", ("true", "false")),
                   _encoded("first", "choice", ("k",))),
        state_tokens=1,
    )
    response = build_response(request, encoding, [0.25, 0.75, 1.0])
    assert response["model"] == "Zoë-1 "
    assert list(response["answers"]) == ["second", "first"]
    assert response["usage"] == {"input_tokens": 42, "output_tokens": 0}
    with pytest.raises(ValueError):
        build_response(request, encoding, [0.25, 0.75, 1.0, 0.0])


def test_serialize_is_compact_utf8_and_refuses_nan() -> None:
    body = serialize({"model": "é", "answers": {"q": {"noul": 0.5}}})
    assert body == '{"model":"é","answers":{"q":{"noul":0.5}}}'.encode()
    assert json.loads(body)["model"] == "é"
    with pytest.raises(ValueError):
        serialize({"noul": float("nan")})

"""Turning per-option probabilities into the `/v1/systemone` response (spec §5).

Decisions (argmax, expected score, confidence) use the unrounded float32 probabilities; every
number written is rounded with Python's `round(x, 4)`. Answers follow the request's question
order, choice probabilities the caller's criteria order (not the sorted encode order), and a
tied choice goes to the first maximum in caller order.

The body is serialised once, here, as compact UTF-8 JSON
(`json.dumps(..., ensure_ascii=False, separators=(",", ":"), allow_nan=False)`, the form
Starlette's JSONResponse writes); the front forwards these bytes unchanged. `allow_nan=False`
turns a non-finite probability into an error (a 500) instead of invalid JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from clef_worker.model.encoding import EncodedQuestion, Encoding

DECIMALS = 4


def _rounded(value: float) -> float:
    return round(float(value), DECIMALS)


def answer_question(
    question: Mapping[str, Any], encoded: EncodedQuestion, probabilities: Sequence[float]
) -> dict[str, Any]:
    """One question's answer from its options' probabilities (encode order)."""
    by_option = dict(zip(encoded.option_ids, probabilities, strict=True))
    kind = encoded.type
    if kind == "noul":
        return {"type": "noul", "noul": _rounded(by_option["true"])}
    if kind == "choice":
        order = [str(key) for key in question["criteria"]]
        best = order[0]
        for option in order[1:]:
            if by_option[option] > by_option[best]:
                best = option
        return {
            "type": "choice",
            "choice": best,
            "confidence": _rounded(by_option[best]),
            "probabilities": {option: _rounded(by_option[option]) for option in order},
        }
    if kind == "score":
        levels = list(question["criteria"])
        values = [by_option[str(index)] for index in range(len(levels))]
        return {
            "type": "score",
            "score": _rounded(sum(index * p for index, p in enumerate(values))),
            "confidence": _rounded(max(values)),
            "legend": {str(index): level for index, level in enumerate(levels)},
            "probabilities": {str(index): _rounded(p) for index, p in enumerate(values)},
        }
    raise ValueError(f"unknown question type {kind!r}")


def build_response(
    request: Mapping[str, Any], encoding: Encoding, probabilities: Sequence[float]
) -> dict[str, Any]:
    """The response object; `probabilities` are all options in question then encode order."""
    answers: dict[str, Any] = {}
    start = 0
    questions = request["questions"]
    for encoded in encoding.questions:
        end = start + len(encoded.option_ids)
        answers[encoded.id] = answer_question(
            questions[encoded.id], encoded, probabilities[start:end]
        )
        start = end
    if start != len(probabilities):
        raise ValueError(f"{len(probabilities)} probabilities for {start} options")
    return {
        "model": request["model"],
        "answers": answers,
        "usage": {"input_tokens": encoding.length, "output_tokens": 0},
    }


def serialize(response: Mapping[str, Any]) -> bytes:
    """The final response body bytes (compact UTF-8 JSON, no NaN/Infinity)."""
    return json.dumps(
        response, ensure_ascii=False, separators=(",", ":"), allow_nan=False
    ).encode("utf-8")

"""Request validation (docs/http-contract.md row 12 -> 422), shared by the front and the worker.

The first three of the reference's checks keep its exact messages and order (docs/model.md,
"Validation"). The fourth (the token budget) needs the tokenizer and lives in the worker's
encoder. Everything the reference leaves unchecked, and crashes or misbehaves on, gets a clear
message here instead, so no request that could crash the model is ever admitted. The front runs
this before admission; the worker runs it again before encoding (it must never trust its input).
"""

from __future__ import annotations

from typing import Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits

# The question types a request may name, in the order the reference's refusal lists them. Which
# type id the head gives each is the model's fact (clef_worker.model.encoding.TYPE_IDS), not this
# module's.
QUESTION_TYPES = ("noul", "choice", "score")

# The reference's refusals (docs/model.md, "Validation", checks 1-3), word for word; `{qid}` is
# the question id. The fourth, the token budget, is the encoder's
# (clef_worker.model.encoding.BUDGET).
MODEL_AND_STATE = "model and state are required"
AT_LEAST_ONE_QUESTION = "at least one question is required"
UNKNOWN_TYPE = f"{{qid}}: type must be {', '.join(QUESTION_TYPES[:-1])}, or {QUESTION_TYPES[-1]}"
NO_CRITERIA = "{qid}: criteria must not be empty"
REFERENCE_REFUSALS = (MODEL_AND_STATE, AT_LEAST_ONE_QUESTION, UNKNOWN_TYPE, NO_CRITERIA)


def _check_question(qid: str, question: Any, limits: RequestLimits) -> None:
    if not isinstance(question, dict):
        raise RequestInvalid(f"{qid}: question must be an object")
    qtype = question.get("type")
    if not isinstance(qtype, str) or qtype not in QUESTION_TYPES:
        raise RequestInvalid(UNKNOWN_TYPE.format(qid=qid))
    criteria = question.get("criteria")
    if qtype != "noul" and not criteria:
        raise RequestInvalid(NO_CRITERIA.format(qid=qid))
    if qtype == "choice":
        if not isinstance(criteria, dict):
            raise RequestInvalid(
                f"{qid}: choice criteria must be an object mapping option ids to descriptions"
            )
        if len(criteria) > limits.max_choice_options:
            raise RequestInvalid(
                f"{qid}: {len(criteria)} options; maximum is {limits.max_choice_options}"
            )
    elif qtype == "score":
        if not isinstance(criteria, list):
            raise RequestInvalid(
                f"{qid}: score criteria must be an array of level descriptions, low to high"
            )
        if len(criteria) > limits.max_score_levels:
            raise RequestInvalid(
                f"{qid}: {len(criteria)} levels; maximum is {limits.max_score_levels}"
            )
    elif criteria and not isinstance(criteria, dict):
        # A falsy value (null, {}, [], "") means "no override", as in the reference.
        raise RequestInvalid(
            f"{qid}: noul criteria must be an object overriding the true and false descriptions"
        )
    if qid == "" and not question.get("instructions"):
        # The instruction would be the empty id: an empty span whose mean is NaN.
        raise RequestInvalid("an empty question id needs non-empty instructions")


def validate_request(request: dict[str, Any], limits: RequestLimits) -> None:
    """Raise RequestInvalid with the first failing rule's message; return None if valid."""
    if not isinstance(request.get("model"), str) or "state" not in request:
        raise RequestInvalid(MODEL_AND_STATE)
    questions = request.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise RequestInvalid(AT_LEAST_ONE_QUESTION)
    if len(questions) > limits.max_questions:
        raise RequestInvalid(
            f"{len(questions)} questions; maximum is {limits.max_questions}"
        )
    for qid, question in questions.items():
        _check_question(qid, question, limits)
    if any(request.get(key) is not None for key in ("images", "videos", "media_kwargs")):
        # Imported here: Pillow loads only for requests that carry media.
        from clef_protocol.media import check_media

        check_media(request, limits)

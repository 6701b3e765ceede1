"""Request validation: the reference's messages and order, and every input it crashes on."""

from __future__ import annotations

from typing import Any

import pytest

from benchlib.golden import load_cases
from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request

LIMITS = RequestLimits()


def req(questions: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "clef-flash", "state": "s", "questions": questions, **extra}


def refusal(request: dict[str, Any], limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(RequestInvalid) as excinfo:
        validate_request(request, limits)
    return str(excinfo.value)


@pytest.mark.parametrize(
    ("request_", "detail"),
    [
        # 1. model and state
        ({"state": "s", "questions": {"a": {"type": "noul"}}}, "model and state are required"),
        ({"model": 3, "state": "s", "questions": {}}, "model and state are required"),
        ({"model": None, "state": "s"}, "model and state are required"),
        ({"model": "m", "questions": {"a": {"type": "noul"}}}, "model and state are required"),
        # 2. questions
        (req({}), "at least one question is required"),
        (req([{"type": "noul"}]), "at least one question is required"),
        (req("a"), "at least one question is required"),
        ({"model": "m", "state": None}, "at least one question is required"),
        # 3. per question, in request order
        (req({"a": {"type": "boolean"}}), "a: type must be noul, choice, or score"),
        (req({"a": {}}), "a: type must be noul, choice, or score"),
        (req({"a": {"type": ["noul"]}}), "a: type must be noul, choice, or score"),
        (req({"a": {"type": "choice"}}), "a: criteria must not be empty"),
        (req({"a": {"type": "choice", "criteria": {}}}), "a: criteria must not be empty"),
        (req({"a": {"type": "score", "criteria": []}}), "a: criteria must not be empty"),
        (req({"a": {"type": "score", "criteria": ""}}), "a: criteria must not be empty"),
        (req({"a": {"type": "score", "criteria": None}}), "a: criteria must not be empty"),
        (
            req({"ok": {"type": "noul"}, "b": {"type": "x"}, "c": {"type": "choice"}}),
            "b: type must be noul, choice, or score",
        ),
    ],
)
def test_reference_checks_keep_their_messages_and_order(request_: dict, detail: str) -> None:
    assert refusal(request_) == detail


@pytest.mark.parametrize(
    ("question", "detail"),
    [
        # Inputs the reference crashes or misbehaves on.
        ("noul", "q: question must be an object"),
        (None, "q: question must be an object"),
        ([{"type": "noul"}], "q: question must be an object"),
        ({"type": "choice", "criteria": ["a", "b"]},
         "q: choice criteria must be an object mapping option ids to descriptions"),
        ({"type": "choice", "criteria": "a"},
         "q: choice criteria must be an object mapping option ids to descriptions"),
        ({"type": "score", "criteria": {"0": "low"}},
         "q: score criteria must be an array of level descriptions, low to high"),
        ({"type": "score", "criteria": "low"},
         "q: score criteria must be an array of level descriptions, low to high"),
        ({"type": "noul", "criteria": "yes"},
         "q: noul criteria must be an object overriding the true and false descriptions"),
        ({"type": "noul", "criteria": ["true"]},
         "q: noul criteria must be an object overriding the true and false descriptions"),
    ],
)
def test_unchecked_by_the_reference(question: Any, detail: str) -> None:
    assert refusal(req({"q": question})) == detail


@pytest.mark.parametrize("instructions", [None, "", 0, False, [], {}])
def test_empty_id_needs_instructions(instructions: Any) -> None:
    question: dict[str, Any] = {"type": "noul"}
    if instructions is not None:
        question["instructions"] = instructions
    assert refusal(req({"": question})) == "an empty question id needs non-empty instructions"


def test_empty_id_with_instructions_is_valid() -> None:
    validate_request(req({"": {"type": "noul", "instructions": "Is it?"}}), LIMITS)


@pytest.mark.parametrize("criteria", [None, {}, [], "", {"true": None, "maybe": 1}])
def test_noul_criteria_that_mean_no_override(criteria: Any) -> None:
    validate_request(req({"q": {"type": "noul", "criteria": criteria}}), LIMITS)


def test_caps() -> None:
    limits = RequestLimits(max_questions=3, max_choice_options=4, max_score_levels=2)
    many = {f"q{i}": {"type": "noul"} for i in range(4)}
    assert refusal(req(many), limits) == "4 questions; maximum is 3"
    validate_request(req(dict(list(many.items())[:3])), limits)
    options = {f"o{i}": None for i in range(5)}
    assert refusal(req({"c": {"type": "choice", "criteria": options}}), limits) == (
        "c: 5 options; maximum is 4"
    )
    assert refusal(req({"s": {"type": "score", "criteria": [1, 2, 3]}}), limits) == (
        "s: 3 levels; maximum is 2"
    )
    validate_request(req({"s": {"type": "score", "criteria": [1, 2]}}), limits)


def test_default_caps_are_enforced_at_their_values() -> None:
    """Under the default limits a request at each cap passes and one over it is refused with a
    message naming the cap; the default token budget is the release's own default."""
    import inspect

    from tests.upstream import upstream_module

    questions = {f"q{i}": {"type": "noul"} for i in range(LIMITS.max_questions + 1)}
    validate_request(req(dict(list(questions.items())[:-1])), LIMITS)
    assert refusal(req(questions)) == (
        f"{len(questions)} questions; maximum is {LIMITS.max_questions}")
    options = {f"o{i}": None for i in range(LIMITS.max_choice_options + 1)}
    validate_request(req({"c": {"type": "choice", "criteria": dict(list(options.items())[:-1])}}),
                     LIMITS)
    assert refusal(req({"c": {"type": "choice", "criteria": options}})) == (
        f"c: {len(options)} options; maximum is {LIMITS.max_choice_options}")
    levels = list(range(LIMITS.max_score_levels + 1))
    validate_request(req({"s": {"type": "score", "criteria": levels[:-1]}}), LIMITS)
    assert refusal(req({"s": {"type": "score", "criteria": levels}})) == (
        f"s: {len(levels)} levels; maximum is {LIMITS.max_score_levels}")
    systemone = inspect.signature(upstream_module().systemone)
    assert LIMITS.max_length == systemone.parameters["max_length"].default


@pytest.mark.parametrize("media", [{"images": ["x.png"]}, {"videos": [{"url": "v"}]}])
def test_media_refused_when_malformed(media: dict) -> None:
    assert refusal(req({"q": {"type": "noul"}}, **media)) == (
        "images[0]: not valid base64 image data (URLs and file paths are never opened; send "
        "the image inline)" if "images" in media else
        "videos[0]: a video must be written [[frame, frame, ...]]"
    )


def test_empty_media_and_extra_keys_are_ignored() -> None:
    validate_request(
        req({"q": {"type": "noul"}}, images=[], videos=None, thinking={"enabled": False},
            id="r1", x_nonce=7),
        LIMITS,
    )


def test_state_may_be_any_json() -> None:
    states: tuple[object, ...] = (None, 0, False, [], {"a": [1]}, "")
    for state in states:
        validate_request({"model": "", "state": state, "questions": {"q": {"type": "noul"}}},
                         LIMITS)


def test_golden_cases_agree_with_the_reference() -> None:
    """Every golden case the reference answered passes; its refusals (but the token budget,
    which needs the tokenizer) get the reference's message."""
    seen = 0
    for case in load_cases():
        error = case.get("error", {}).get("message", "")
        if error.startswith("schema requires"):
            continue
        limits = RequestLimits(max_length=case["max_length"])
        if error:
            assert refusal(case["request"], limits) == error, case["name"]
        else:
            validate_request(case["request"], limits)
        seen += 1
    assert seen == 23


@pytest.mark.parametrize("request_", [
    {"state": "s", "questions": {"a": {"type": "noul"}}},
    {"model": "m", "questions": {"a": {"type": "noul"}}},
    req({}),
    req({"a": {"type": "noul"}, "b": {"type": "maybe"}}),
    req({"a": {"type": "choice"}}),
    req({"a": {"type": "score", "criteria": []}}),
    req({"a": {"type": "noul"}, "b": {"type": "choice", "criteria": {}}}),
])
def test_refusals_are_the_release_s_own(request_: dict[str, Any]) -> None:
    """Where the release's `systemone` refuses a request itself (its checks run before it
    touches the model), this validation refuses it with the same text."""
    from tests.upstream import upstream_module

    with pytest.raises(ValueError) as theirs:
        upstream_module().systemone(None, None, request_)
    assert refusal(request_) == str(theirs.value)

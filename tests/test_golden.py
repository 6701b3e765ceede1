"""Golden parity: every case of ../shared/fixtures/clef-tiny.golden.jsonl through the native
executor, in float32 on CPU with the case's max_length (the rules of ../shared/README.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clef_protocol.options import RequestLimits
from clef_protocol.validation import RequestInvalid
from clef_worker.native import NativeExecutor, Scored
from tests.conftest import GOLDEN

LOGIT_TOLERANCE = 1e-4
PROBABILITY_KEYS = ("noul", "confidence")


def _cases() -> list[dict[str, Any]]:
    if not GOLDEN.is_file():
        return []
    return [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line]


CASES = _cases()
SUCCESS = [case for case in CASES if "error" not in case]
ERRORS = [case for case in CASES if "error" in case]


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return NativeExecutor.load(tiny_snapshot, device="cpu", dtype="float32",
                               gdn_prefill="auto", limits=RequestLimits())


def _for_case(executor: NativeExecutor, case: dict[str, Any]) -> NativeExecutor:
    return executor.with_limits(dataclasses.replace(executor.limits,
                                                    max_length=case["max_length"]))


_SCORED: dict[str, Scored] = {}


def _scored(executor: NativeExecutor, case: dict[str, Any]) -> Scored:
    """Each case is scored once per module and shared by the tests that inspect it."""
    if case["name"] not in _SCORED:
        _SCORED[case["name"]] = _for_case(executor, case).score(case["request"])
    return _SCORED[case["name"]]


def test_golden_file_present() -> None:
    assert len(CASES) == 24, f"expected 24 golden cases in {GOLDEN}"


@pytest.mark.parametrize("case", SUCCESS, ids=[case["name"] for case in SUCCESS])
def test_tokens_spans_and_logits(executor: NativeExecutor, case: dict[str, Any]) -> None:
    scored = _scored(executor, case)
    assert scored.encoding.input_ids == case["input_ids"]
    assert len(scored.encoding.questions) == len(case["questions"])
    offset = 0
    for encoded, golden in zip(scored.encoding.questions, case["questions"], strict=True):
        assert encoded.id == golden["id"]
        assert encoded.type_id == golden["type"]
        assert list(encoded.question_span) == golden["question_span"]
        assert [list(span) for span in encoded.option_spans] == golden["option_spans"]
        assert list(encoded.option_ids) == golden["option_ids"]
        count = len(golden["option_ids"])
        logits = scored.logits[offset:offset + count]
        for got, want in zip(logits, golden["logits"], strict=True):
            assert abs(got - want) <= LOGIT_TOLERANCE, (encoded.id, got, want)
        offset += count
    assert offset == len(scored.logits)


@pytest.mark.parametrize("case", SUCCESS, ids=[case["name"] for case in SUCCESS])
def test_response_body(executor: NativeExecutor, case: dict[str, Any]) -> None:
    case_executor = _for_case(executor, case)
    answer = case_executor.answer(json.dumps(case["request"]).encode("utf-8"))
    assert answer.input_tokens == len(case["input_ids"])
    # Only a state that filled the budget was cut.
    assert (answer.truncated_tokens > 0) == (len(case["input_ids"]) == case["max_length"])
    assert_response_matches(json.loads(answer.body), case["response"],
                            _unrounded(_scored(executor, case)))


@pytest.mark.parametrize("case", ERRORS, ids=[case["name"] for case in ERRORS])
def test_refused_with_reference_message(executor: NativeExecutor, case: dict[str, Any]) -> None:
    body = json.dumps(case["request"]).encode("utf-8")
    with pytest.raises(RequestInvalid) as refused:
        _for_case(executor, case).answer(body)
    assert str(refused.value) == case["error"]["message"]


def test_body_is_compact_utf8(executor: NativeExecutor) -> None:
    case = next(case for case in SUCCESS if case["name"] == "unicode_ids")
    body = _for_case(executor, case).answer(json.dumps(case["request"]).encode("utf-8")).body
    assert "état du colis".encode() in body  # not \u-escaped
    assert b", " not in body and b": " not in body


def _unrounded(scored: Scored) -> list[float]:
    return list(scored.probabilities)


def _near_boundary(values: list[float], rounded: float) -> bool:
    """Whether some unrounded probability rounds to `rounded` from within 1e-6 of a half-unit."""
    for value in values:
        scaled = value * 10_000
        if abs(scaled - math.floor(scaled) - 0.5) < 1e-2 and abs(round(value, 4) - rounded) < 1e-9:
            return True
    return False


def _leaves(got: Any, want: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key in want:
            yield from _leaves(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            yield from _leaves(g, w, f"{path}[{index}]")
    else:
        yield path, got, want


def assert_response_matches(got: Any, want: Any, unrounded: list[float]) -> None:
    """Equal after json.loads (key order included), except that a probability may differ by one
    unit in the 4th decimal where its unrounded value sits on a rounding boundary."""
    for path, g, w in _leaves(got, want, "$"):
        if g == w and type(g) is type(w):
            continue
        is_probability = ".probabilities." in path or path.rsplit(".", 1)[-1] in PROBABILITY_KEYS
        assert is_probability and isinstance(g, float) and isinstance(w, float), (path, g, w)
        assert abs(g - w) <= 1e-4 + 1e-12, (path, g, w)
        assert _near_boundary(unrounded, g), (path, g, w, "not on a rounding boundary")


def test_malformed_body_is_refused_before_the_model(executor: NativeExecutor) -> None:
    from clef_protocol.body import BadRequestBody

    with pytest.raises(BadRequestBody):
        executor.answer(b'{"model": "m", "state": ')
    with pytest.raises(RequestInvalid, match=r"^images\[0\]: not valid base64"):
        executor.answer(json.dumps({"model": "m", "state": "s", "images": ["x"],
                                    "questions": {"a": {"type": "noul"}}}).encode())


def test_text_cases_run_with_media_enabled(executor: NativeExecutor) -> None:
    """The cases above ran with the vision tower loaded (--media auto on a snapshot that has
    one): text-only requests are unchanged by media support."""
    assert executor.vision is not None and executor.limits.media

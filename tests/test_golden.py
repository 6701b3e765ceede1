"""Golden parity: every case of tests/fixtures/clef-tiny.golden.jsonl through the native
executor, in float32 on CPU with the case's max_length (the rules of tests/fixtures/README.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from benchlib.executors import with_limits
from benchlib.golden import GOLDEN, Drift, answered, assert_response_matches, load_cases, refused
from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.native import NativeExecutor, Scored

CASES = load_cases()
SUCCESS = answered()
ERRORS = refused()


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               gdn_prefill="auto", limits=RequestLimits())


def _for_case(executor: NativeExecutor, case: dict[str, Any]) -> NativeExecutor:
    return with_limits(executor, dataclasses.replace(executor.limits,
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
    for encoded, golden in zip(scored.encoding.questions, case["questions"], strict=True):
        assert encoded.id == golden["id"]
        assert encoded.type_id == golden["type"]
        assert list(encoded.question_span) == golden["question_span"]
        assert [list(span) for span in encoded.option_spans] == golden["option_spans"]
        assert list(encoded.option_ids) == golden["option_ids"]
    drift = Drift()
    drift.add(case, scored.logits, scored.probabilities)
    assert drift.within_tolerance, drift


@pytest.mark.parametrize("case", SUCCESS, ids=[case["name"] for case in SUCCESS])
def test_response_body(executor: NativeExecutor, case: dict[str, Any]) -> None:
    case_executor = _for_case(executor, case)
    answer = case_executor.answer(json.dumps(case["request"]).encode("utf-8"))
    assert answer.input_tokens == len(case["input_ids"])
    # Only a state that filled the budget was cut.
    assert (answer.truncated_tokens > 0) == (len(case["input_ids"]) == case["max_length"])
    assert_response_matches(json.loads(answer.body), case["response"],
                            _scored(executor, case).probabilities)


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


def test_malformed_body_is_refused_before_the_model(executor: NativeExecutor) -> None:
    from clef_protocol.errors import BadRequestBody

    with pytest.raises(BadRequestBody):
        executor.answer(b'{"model": "m", "state": ')
    with pytest.raises(RequestInvalid, match=r"^images\[0\]: not valid base64"):
        executor.answer(json.dumps({"model": "m", "state": "s", "images": ["x"],
                                    "questions": {"a": {"type": "noul"}}}).encode())


def test_text_cases_run_with_media_enabled(executor: NativeExecutor) -> None:
    """The cases above ran with the vision tower loaded (--media auto on a snapshot that has
    one): text-only requests are unchanged by media support."""
    assert executor.vision is not None and executor.limits.media

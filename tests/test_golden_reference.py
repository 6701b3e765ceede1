"""The checked-in text golden file still says what the pinned upstream reference says.

A sample of tests/fixtures/clef-tiny.golden.jsonl (refusals, a cut state, unusual encodings, the
largest schema) is answered again by `joint_schema_model.py` of `clef-finetune==0.1.0`
(tests/golden_reference.py) and compared with the file under benchlib.golden's rules, so the
answers every parity test trusts cannot drift from the reference unnoticed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchlib.golden import LOGIT_TOLERANCE, assert_response_matches, case
from clef_worker.release import ReleaseExecutor
from tests.golden_reference import reference, regenerate

SAMPLE = ["invoice", "truncated_state", "schema_too_long", "empty_criteria", "object_state",
          "special_token_text", "big_integer", "unicode_ids", "forty_options", "missing_model"]


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[ReleaseExecutor]:
    with reference(tmp_path_factory.mktemp("reference"), tiny_snapshot) as loaded:
        yield loaded


@pytest.mark.parametrize("name", SAMPLE)
def test_the_reference_still_gives_the_checked_in_answer(executor: ReleaseExecutor,
                                                         name: str) -> None:
    want = case(name)
    got = regenerate(executor, want["name"], want["request"], want["max_length"])
    assert list(got) == list(want)
    if "error" in want:
        assert got["error"] == want["error"]
        return
    assert got["input_ids"] == want["input_ids"]
    assert_response_matches(got["response"], want["response"])
    for mine, theirs in zip(got["questions"], want["questions"], strict=True):
        exact = ("id", "type", "question_span", "option_spans", "option_ids")
        assert {k: mine[k] for k in exact} == {k: theirs[k] for k in exact}
        for key in ("logits", "probabilities"):
            assert mine[key] == pytest.approx(theirs[key], abs=LOGIT_TOLERANCE), (name, key)


def test_the_sample_covers_both_kinds_of_case() -> None:
    """The sample names real cases, answered and refused (a renamed case fails here, not by
    silently shrinking the sample)."""
    kinds = {"error" in case(name) for name in SAMPLE}
    assert kinds == {True, False}

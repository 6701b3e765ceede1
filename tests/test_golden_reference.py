"""The checked-in text golden file still says what the pinned upstream reference says.

A sample of tests/fixtures/clef-tiny.golden.jsonl (refusals, a cut state, unusual encodings, the
largest schema) is answered again by `joint_schema_model.py` of `clef-finetune==0.1.0`
(tests/golden_reference.py) and compared with the file under benchlib.golden's rules, so the
answers every parity test trusts cannot drift from the reference unnoticed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchlib.golden import LOGIT_TOLERANCE, case
from clef_worker.release import ReleaseExecutor
from tests.golden_reference import differences, reference, regenerate

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
    assert differences(got, want) == []


def test_a_departure_from_the_file_is_reported() -> None:
    """The comparison the remake command and this module share can fail: a logit moved past
    the tolerance, a token id changed, a refusal reworded."""
    want = case("invoice")
    assert differences(want, want) == []
    moved = json.loads(json.dumps(want))
    moved["questions"][0]["logits"][0] += 10 * LOGIT_TOLERANCE
    moved["input_ids"][0] += 1
    found = differences(moved, want)
    assert any("input_ids" in problem for problem in found)
    assert any("logits off by" in problem for problem in found)
    refusal = case("missing_model")
    reworded = dict(refusal, error={**refusal["error"], "message": "something else"})
    assert differences(reworded, refusal) != []


def test_the_sample_covers_both_kinds_of_case() -> None:
    """The sample names real cases, answered and refused (a renamed case fails here, not by
    silently shrinking the sample)."""
    kinds = {"error" in case(name) for name in SAMPLE}
    assert kinds == {True, False}

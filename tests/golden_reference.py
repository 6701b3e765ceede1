"""The text golden cases, answered again by the pinned upstream reference.

tests/fixtures/clef-tiny.golden.jsonl was made by the release's own `joint_schema_model.py`
(the copy `clef-finetune==0.1.0` carries, tests/upstream.py) in float32 on CPU. This module
answers a case's request the same way, with the upstream file's own encoder, forward pass,
answer format and validation, so that the checked-in answers can be compared with what the
reference says today (tests/test_golden_reference.py) and the file can be remade, into a new file
that is then compared with the checked-in one (never over its own input):

    python -m tests.golden_reference --out /tmp/clef-tiny.golden.jsonl

Only the loading goes through this project (`--executor release`, which blocks fla on CPU and
checks the snapshot). By default a text-only processor stands in for the release's processor,
which needs a torchvision built for the installed torch (tests/upstream.py says why), so media
cases are out of reach; `--full-processor` builds the release's own processor instead, for a host
that has that torchvision (the media golden file's cases; its `media` objects are not remade).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from benchlib.golden import LOGIT_TOLERANCE, assert_response_matches, load_cases
from benchlib.paths import GOLDEN, TINY_SNAPSHOT
from clef_protocol.options import RequestLimits
from clef_worker.release import ReleaseExecutor
from tests.upstream import release_snapshot, use_text_only_processor

__all__ = ["differences", "main", "reference", "regenerate"]


@contextmanager
def reference(workdir: Path, snapshot: Path = TINY_SNAPSHOT, *, full_processor: bool = False
              ) -> Iterator[ReleaseExecutor]:
    """The upstream reference loaded on `snapshot` (copied under `workdir` with the release's
    file added), in float32 on CPU as the golden files were made."""
    with pytest.MonkeyPatch.context() as patch:
        if not full_processor:
            use_text_only_processor(patch)
        executor = ReleaseExecutor.load(
            release_snapshot(snapshot, workdir / "snapshot"), variant="clef-flash",
            device="cpu", dtype="float32", gdn_prefill="torch", limits=RequestLimits())
    yield executor


@torch.inference_mode()
def regenerate(executor: ReleaseExecutor, name: str, request: dict[str, Any],
               max_length: int) -> dict[str, Any]:
    """One golden line for `request`, every field computed by the upstream file: the response
    (or the reference's refusal), the token ids, the spans and the unrounded per-option values."""
    module, model, processor = executor.upstream_module, executor.model, executor.processor
    line: dict[str, Any] = {"name": name, "request": request, "max_length": max_length}
    try:
        line["response"] = module.systemone(model, processor, request, max_length=max_length)
    except ValueError as refusal:
        line["error"] = {"type": type(refusal).__name__, "message": str(refusal)}
        return line
    encoded = module.encode_record(processor.tokenizer, request, max_length=max_length,
                                   processor=processor)
    batch = module.collate_records([encoded], processor.tokenizer.pad_token_id, torch.device("cpu"))
    logits = model(batch)[0]
    line["input_ids"] = list(encoded.input_ids)
    line["questions"] = [
        {"id": question.question_id, "type": question.question_type,
         "question_span": list(question.question_span),
         "option_spans": [list(span) for span in question.option_spans],
         "option_ids": list(question.option_ids),
         "logits": values.float().tolist(),
         "probabilities": values.float().softmax(-1).tolist()}
        for question, values in zip(encoded.questions, logits, strict=True)
    ]
    return line


# Fields of a golden line compared exactly; logits and probabilities within LOGIT_TOLERANCE.
EXACT = ("id", "type", "question_span", "option_spans", "option_ids")
# What the media golden file holds that this module does not remake (its debugging `media`
# object, read from the processor's output).
NOT_REMADE = ("media",)


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """How a re-answered golden line departs from the checked-in one under benchlib.golden's
    rules; empty when they match."""
    problems: list[str] = []
    kept = [key for key in want if key not in NOT_REMADE]
    if list(got) != kept:
        return [f"keys {list(got)}, the file has {kept}"]
    if "error" in want:
        return [] if got["error"] == want["error"] else [f"error {got['error']}"]
    if got["input_ids"] != want["input_ids"]:
        problems.append("input_ids differ")
    try:
        assert_response_matches(got["response"], want["response"])
    except AssertionError as mismatch:
        problems.append(f"response: {mismatch}")
    if len(got["questions"]) != len(want["questions"]):
        return [*problems, "a different number of questions"]
    for mine, theirs in zip(got["questions"], want["questions"], strict=True):
        if {k: mine[k] for k in EXACT} != {k: theirs[k] for k in EXACT}:
            problems.append(f"question {theirs['id']}: ids, spans or option order differ")
        for key in ("logits", "probabilities"):
            worst = max((abs(a - b) for a, b in zip(mine[key], theirs[key], strict=True)),
                        default=0.0)
            if len(mine[key]) != len(theirs[key]) or worst > LOGIT_TOLERANCE:
                problems.append(f"question {theirs['id']}: {key} off by {worst:.2e}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Answer the golden file's requests again with the upstream reference, write "
                    "the golden lines (JSONL) to a new file and compare them with the file's.")
    parser.add_argument("--golden", type=Path, default=GOLDEN,
                        help="the file whose cases (name, request, max_length) are re-answered "
                             "and compared with")
    parser.add_argument("--out", type=Path, required=True,
                        help="the new file to write (refused if it exists: the golden file is "
                             "this command's input, never its output)")
    parser.add_argument("--snapshot", type=Path, default=TINY_SNAPSHOT)
    parser.add_argument("--case", action="append", default=[],
                        help="only this case (repeatable); default every case")
    parser.add_argument("--full-processor", action="store_true",
                        help="the release's own processor (needs torchvision built for the "
                             "installed torch), for media cases")
    args = parser.parse_args(argv)
    if args.out.exists():
        parser.error(f"{args.out} exists: write to a new file, then compare or move it yourself")
    cases = [c for c in load_cases(args.golden) if not args.case or c["name"] in args.case]
    if not cases:
        parser.error(f"no cases to answer in {args.golden}")
    import tempfile

    differing = 0
    with tempfile.TemporaryDirectory() as workdir, \
            reference(Path(workdir), args.snapshot, full_processor=args.full_processor) \
            as executor, args.out.open("x", encoding="utf-8") as out:
        for case in cases:
            line = regenerate(executor, case["name"], case["request"], case["max_length"])
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            problems = differences(line, case)
            differing += bool(problems)
            identical = json.dumps(line, ensure_ascii=False) == json.dumps(
                {k: v for k, v in case.items() if k not in NOT_REMADE}, ensure_ascii=False)
            verdict = "identical" if identical else "matches" if not problems else "DIFFERS"
            print(f"{case['name']}: {verdict}{': ' + '; '.join(problems) if problems else ''}")
    print(f"{len(cases)} cases written to {args.out}; {differing} differ from {args.golden}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())

"""The text golden cases, answered again by the pinned upstream reference.

tests/fixtures/clef-tiny.golden.jsonl was made by the release's own `joint_schema_model.py`
(the copy `clef-finetune==0.1.0` carries, tests/upstream.py) in float32 on CPU. This module
answers a case's request the same way, with the upstream file's own encoder, forward pass,
answer format and validation, so that the checked-in answers can be compared with what the
reference says today (tests/test_golden_reference.py) and the file can be rebuilt:

    python -m tests.golden_reference > tests/fixtures/clef-tiny.golden.jsonl

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

from benchlib.golden import load_cases
from benchlib.paths import GOLDEN, TINY_SNAPSHOT
from clef_protocol.options import RequestLimits
from clef_worker.release import ReleaseExecutor
from tests.upstream import release_snapshot, use_text_only_processor

__all__ = ["main", "reference", "regenerate"]


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Answer the golden file's requests again with the upstream reference and "
                    "print the golden lines (JSONL) on stdout.")
    parser.add_argument("--golden", type=Path, default=GOLDEN,
                        help="the file whose cases (name, request, max_length) are re-answered")
    parser.add_argument("--snapshot", type=Path, default=TINY_SNAPSHOT)
    parser.add_argument("--case", action="append", default=[],
                        help="only this case (repeatable); default every case")
    parser.add_argument("--full-processor", action="store_true",
                        help="the release's own processor (needs torchvision built for the "
                             "installed torch), for media cases")
    args = parser.parse_args(argv)
    cases = [c for c in load_cases(args.golden) if not args.case or c["name"] in args.case]
    if not cases:
        parser.error(f"no cases to answer in {args.golden}")
    import tempfile

    with tempfile.TemporaryDirectory() as workdir, \
            reference(Path(workdir), args.snapshot, full_processor=args.full_processor) as executor:
        for case in cases:
            line = regenerate(executor, case["name"], case["request"], case["max_length"])
            sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

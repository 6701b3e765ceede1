"""Where the repository and its test fixtures are: one owner for every path that benchmarks,
stress scenarios and tests read.

The fixtures (the tiny `clef-tiny` snapshot and its golden answers) live in the repository, in
`tests/fixtures/` (what each file is and how it was made: tests/fixtures/README.md), so a bare
clone tests itself. `CLEF_FIXTURES` names another directory with the same layout instead.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("CLEF_FIXTURES") or REPO / "tests" / "fixtures")
TINY_SNAPSHOT = FIXTURES / "clef-tiny"
GOLDEN = FIXTURES / "clef-tiny.golden.jsonl"
MEDIA_GOLDEN = FIXTURES / "clef-tiny.media.golden.jsonl"
FINETUNE_FIXTURES = REPO / "tests" / "fixtures" / "finetune"
"""Two clef-finetune checkpoints of `TINY_SNAPSHOT` (`tiny-alpha`, `tiny-beta`), as the variant
tests serve them with `--finetune`; always in the repository (made by make_variants.py there)."""
FINETUNE_REFERENCE = FINETUNE_FIXTURES / "reference.jsonl"
"""The upstream reference's answers on those checkpoints' fp32-merged releases."""
FAKE_WORKER = REPO / "tests" / "fake_worker.py"
"""The zero-work worker the front's tests, the stress scenarios and `bench_http.py --zero-work`
run clef-serve against (it answers at once)."""

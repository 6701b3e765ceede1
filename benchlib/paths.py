"""Where the repository and the shared reference fixtures are: one owner for every path that
benchmarks, stress scenarios and tests read.

The fixtures (`clef-tiny`, the golden answers) live in `../shared/fixtures`, beside the
repository rather than in it; `CLEF_FIXTURES` points elsewhere (a GPU host receives a copy in
`.gpu/fixtures`, because nothing outside the repository travels there).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("CLEF_FIXTURES") or REPO.parent / "shared" / "fixtures")
TINY_SNAPSHOT = FIXTURES / "clef-tiny"
GOLDEN = FIXTURES / "clef-tiny.golden.jsonl"
MEDIA_GOLDEN = FIXTURES / "clef-tiny.media.golden.jsonl"
FAKE_WORKER = REPO / "tests" / "fake_worker.py"
"""The zero-work worker the front's tests, the stress scenarios and `bench_http.py --zero-work`
run clef-serve against (it answers at once)."""

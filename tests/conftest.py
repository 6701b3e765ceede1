"""Shared test fixtures: where the reference material lives."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TINY_SNAPSHOT = SHARED / "fixtures" / "clef-tiny"
GOLDEN = SHARED / "fixtures" / "clef-tiny.golden.jsonl"


@pytest.fixture(scope="session")
def tiny_snapshot() -> Path:
    if not TINY_SNAPSHOT.is_dir():
        pytest.fail(f"reference fixture missing: {TINY_SNAPSHOT} (../shared must sit beside "
                    "the repository)")
    return TINY_SNAPSHOT

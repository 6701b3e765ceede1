"""Shared test fixtures: where the reference material lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from tests.golden import GOLDEN as GOLDEN  # one owner (tests/golden.py); re-exported here
from tests.golden import MEDIA_GOLDEN as MEDIA_GOLDEN

# On CI, property tests draw the same examples every run: a red CI is then reproducible, and a
# change cannot pass by luck. Locally they keep exploring new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
TINY_SNAPSHOT = SHARED / "fixtures" / "clef-tiny"


@pytest.fixture(scope="session")
def tiny_snapshot() -> Path:
    if not TINY_SNAPSHOT.is_dir():
        pytest.fail(f"reference fixture missing: {TINY_SNAPSHOT} (../shared must sit beside "
                    "the repository)")
    return TINY_SNAPSHOT

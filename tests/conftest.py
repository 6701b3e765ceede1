"""Shared test fixtures: the tiny snapshot and golden files in tests/fixtures/ (benchlib.paths
owns the paths)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from benchlib.paths import GOLDEN as GOLDEN  # re-exported for the tests that import them here
from benchlib.paths import MEDIA_GOLDEN as MEDIA_GOLDEN
from benchlib.paths import REPO as REPO
from benchlib.paths import TINY_SNAPSHOT as TINY_SNAPSHOT

# Under CI a skip (at collection too) or an xfail that is not strict fails the run unless no CI
# machine can meet its reason (no GPU): the hooks that collect them and check at the session's
# end (tests/ci_policy.py; tests/test_ci_policy.py runs these very lines in generated sessions).
from tests.ci_policy import pytest_collectreport as pytest_collectreport
from tests.ci_policy import pytest_itemcollected as pytest_itemcollected
from tests.ci_policy import pytest_runtest_logreport as pytest_runtest_logreport
from tests.ci_policy import pytest_sessionfinish as pytest_sessionfinish
from tests.ci_policy import pytest_terminal_summary as pytest_terminal_summary

VERDICTS_ENV = "CLEF_SELF_CHECK_DIR"  # clef_worker.starting.verdict_store.DIRECTORY_ENV

# On CI, property tests draw the same examples every run: a red CI is then reproducible, and a
# change cannot pass by luck. Locally they keep exploring new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_snapshot() -> Path:
    if not TINY_SNAPSHOT.is_dir():
        pytest.fail(f"test fixture missing: {TINY_SNAPSHOT} (tests/fixtures/clef-tiny is part of "
                    "the repository; CLEF_FIXTURES, when set, must name a directory holding it)")
    return TINY_SNAPSHOT


@pytest.fixture(scope="session", autouse=True)
def _session_self_check_verdicts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The start-up self-check's kept verdicts (clef_worker.starting.verdict_store) of the servers
    that module-scoped fixtures start go to this session's own directory, never the user's cache:
    a test's outcome must not depend on what an earlier run kept."""
    before = os.environ.get(VERDICTS_ENV)
    os.environ[VERDICTS_ENV] = str(tmp_path_factory.mktemp("self-check-session"))
    yield
    if before is None:
        os.environ.pop(VERDICTS_ENV, None)
    else:
        os.environ[VERDICTS_ENV] = before


@pytest.fixture(autouse=True)
def _own_self_check_verdicts(tmp_path_factory: pytest.TempPathFactory,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test keeps its own start-up self-check verdicts, the workers it starts in
    subprocesses too: a verdict kept by one test's passing worker would otherwise let another
    test's worker, with a fault injected into its serving path, skip the check that must catch
    the fault."""
    monkeypatch.setenv(VERDICTS_ENV, str(tmp_path_factory.mktemp("self-check")))

"""`clef-serve warm-cache MODEL-FLAGS...` (the worker's `--warm-only`): the whole start-up with
no front, leaving behind what the next worker reuses, then exit 0; exit 1 with the reason when
the worker could not start. On CPU no kernel is compiled, so what a test can see left behind is
the kept self-check verdict, which a worker started afterwards on the same flags reuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchlib.paths import REPO, TINY_SNAPSHOT
from tests.worker_start import start_worker


def _warm_cache(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clef_frontend", "warm-cache", *flags],
                          cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                          timeout=600, check=False)


def test_warm_cache_leaves_a_verdict_the_next_worker_reuses() -> None:
    verdicts = Path(os.environ["CLEF_SELF_CHECK_DIR"])  # this test's own (conftest)
    done = _warm_cache("--model", str(TINY_SNAPSHOT), "--device", "cpu")
    assert done.returncode == 0, done.stderr
    assert "warm-only: done" in done.stderr and "self-check passed and kept" in done.stderr
    assert "ready in" in done.stderr and "imports_s" in done.stderr
    assert list(verdicts.glob("*.json"))
    executor, frame = start_worker(TINY_SNAPSHOT)
    assert executor is not None and frame["self_check"]["reused"] is True


def test_warm_cache_fails_with_the_reason(tmp_path: Path) -> None:
    done = _warm_cache("--model", str(tmp_path / "nothing-here"), "--device", "cpu")
    assert done.returncode == 1
    assert "cannot start" in done.stderr and "nothing-here" in done.stderr

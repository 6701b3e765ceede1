"""`clef-serve --version`'s commit: git's answer in a checkout, the recorded one in a wheel,
nothing when neither is known (clef_frontend/build_info.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clef_frontend import build_info, version

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=m"]


def _repo(path: Path) -> str:
    subprocess.run([*GIT, "init", "-q", str(path)], check=True)
    (path / "f").write_text("one\n")
    subprocess.run([*GIT, "-C", str(path), "add", "f"], check=True)
    subprocess.run([*GIT, "-C", str(path), "commit", "-qm", "c"], check=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_a_checkout_gives_its_head_and_says_when_tracked_files_changed(tmp_path: Path) -> None:
    head = _repo(tmp_path)
    assert build_info.git_commit(tmp_path) == head
    (tmp_path / "untracked").write_text("x")
    assert build_info.git_commit(tmp_path) == head
    (tmp_path / "f").write_text("two\n")
    assert build_info.git_commit(tmp_path) == f"{head}+dirty"


def test_a_folder_inside_someone_elses_checkout_is_not_a_checkout(tmp_path: Path) -> None:
    """An unpacked sdist inside another repository must not report that repository's HEAD."""
    _repo(tmp_path)
    inner = tmp_path / "clef-serve-0.1.0"
    inner.mkdir()
    assert build_info.git_commit(inner) is None


def test_the_recorded_commit_is_read_from_build_commit(tmp_path: Path) -> None:
    assert build_info.recorded_commit(tmp_path) is None
    (tmp_path / build_info.BUILD_COMMIT).write_text("ab" * 20 + "\n")
    assert build_info.recorded_commit(tmp_path) == "ab" * 20


def test_the_version_line_names_the_commit_only_when_known(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(version, "commit", lambda: "cd" * 20)
    assert version.describe() == f"clef-serve {version.version()} (commit {'cd' * 20})"
    monkeypatch.setattr(version, "commit", lambda: None)
    assert version.describe() == f"clef-serve {version.version()}"


def test_version_from_this_checkout_names_its_head() -> None:
    """Run from the repository (as the tests are), `--version` asks git, when it is a checkout."""
    root = Path(build_info.__file__).resolve().parent.parent
    expected = build_info.git_commit(root)
    line = subprocess.run([sys.executable, "-m", "clef_frontend", "--version"], cwd=root,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    if expected is None:
        assert "(commit" not in line  # a copy without .git (CI's stand-alone run)
    else:
        assert line.endswith(f"(commit {expected})")

"""`clef-serve --version`'s commit: git's answer in a checkout, the recorded one in a wheel,
nothing when neither is known (clef_protocol/build_info.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clef_frontend import version
from clef_protocol import build_info

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


def test_the_version_line_of_this_tree_names_its_commit() -> None:
    """`python -m clef_frontend --version` run from this tree (as the tests are) names the commit
    that git reports for a checkout (asked here directly, not through build_info), or, in an
    unpacked sdist, the one its BUILD_COMMIT recorded (CI runs the suite there)."""
    root = Path(build_info.__file__).resolve().parent.parent
    line = subprocess.run([sys.executable, "-m", "clef_frontend", "--version"], cwd=root,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert line.startswith(f"clef-serve {version.version()}")
    if (root / ".git").exists():
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        edited = subprocess.run(["git", "-C", str(root), "diff", "--quiet", "HEAD", "--"],
                                check=False).returncode != 0
        assert re.fullmatch(r"[0-9a-f]{40}", head)
        assert line.endswith(f"(commit {head}{'+dirty' if edited else ''})")
    else:
        recorded = root / build_info.BUILD_COMMIT
        assert recorded.is_file(), "neither a checkout nor an unpacked sdist: what is this tree?"
        assert line.endswith(f"(commit {recorded.read_text().strip()})")


def test_an_unpacked_sdist_names_the_commit_it_recorded(tmp_path: Path) -> None:
    """The protocol package (build_info's home) copied into a tree with a root BUILD_COMMIT and
    no .git, as an unpacked sdist is: `--version` names that commit."""
    package = Path(build_info.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "clef_protocol",
                    ignore=shutil.ignore_patterns("__pycache__", build_info.BUILD_COMMIT))
    (tmp_path / build_info.BUILD_COMMIT).write_text("ef" * 20 + "\n")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from clef_protocol import build_info;"
            "print(build_info.__file__); print(build_info.commit())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert Path(out[0]).is_relative_to(tmp_path) and out[1] == "ef" * 20


def test_the_worker_never_imports_the_front() -> None:
    """The build information is read by both processes from clef_protocol: no clef_worker
    module imports clef_frontend (the worker must load without the front's package)."""
    import ast

    root = Path(build_info.__file__).resolve().parent.parent / "clef_worker"
    importers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [])
            if any(name.split(".")[0] == "clef_frontend" for name in names):
                importers.append(str(path.relative_to(root)))
    assert importers == []

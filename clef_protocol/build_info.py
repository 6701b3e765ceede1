"""Which commit this copy of clef-serve was built from, when that is known.

Two ways to know it, each true where it applies:
- running from a git checkout (an editable install, `python -m clef_frontend` in the repository):
  the checkout's own HEAD, asked of git at that moment, with `+dirty` when tracked files differ
  from it;
- running from a wheel: the commit recorded in the package's `BUILD_COMMIT` file when the wheel
  was built (setup.py writes it, from git, or from the sdist's copy of it when the wheel is built
  from an sdist, which has no `.git`);
- running from an unpacked sdist (its tests run there): the commit the sdist recorded in the
  `BUILD_COMMIT` at its root.
Anything else (a tarball without the file, git missing) is "unknown", never a guess.

Standard library only, and importable without its package: setup.py loads this file by path at
build time, before any dependency is installed. It lives in clef_protocol because both the front
(`--version`) and the worker (the kept self-check verdict's key) read it, and the worker never
imports the front.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

BUILD_COMMIT = "BUILD_COMMIT"
"""The file, inside the `clef_protocol` package of a built wheel and at the root of an sdist,
that holds the commit it was built from (one line)."""

PACKAGE = Path(__file__).resolve().parent


def git_commit(root: Path) -> str | None:
    """The HEAD of the git checkout at `root` (`+dirty` if tracked files changed); None when
    `root` is not the top of a checkout or git cannot say."""
    if not (root / ".git").exists():  # a directory, or a file in a worktree
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                  "--untracked-files=no"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if changed else head or None


def recorded_commit(directory: Path) -> str | None:
    """The commit in `directory`'s BUILD_COMMIT file, if it has one."""
    try:
        text = (directory / BUILD_COMMIT).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def commit() -> str | None:
    """The commit this running copy came from: the checkout's, else the wheel's record, else the
    unpacked sdist's."""
    return (git_commit(PACKAGE.parent) or recorded_commit(PACKAGE)
            or recorded_commit(PACKAGE.parent))

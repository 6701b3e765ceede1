"""What every benchmark result records about how it was made (a helper, not a benchmark).

A result file must say which command produced it, and must not embed the paths of the machine
it ran on (a home directory, a scratch folder, a virtual environment): those say nothing about
the numbers and differ on every host. `command_line` gives the command as it can be re-run from
the repository root, with any path argument reduced to its repository-relative form or, outside
the repository, its file name.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def portable_path(value: str) -> str:
    """A path-looking argument without its host prefix; anything else unchanged."""
    if not value.startswith(("/", "~")):
        return value
    path = Path(value).expanduser()
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def command_line(script: str, argv: list[str] | None = None) -> str:
    """`python bench/<script> <args>` with host paths removed (`argv` defaults to sys.argv)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"bench/{Path(script).name}",
                     *(shlex.quote(_portable_arg(arg)) for arg in args)])


def _portable_arg(arg: str) -> str:
    if arg.startswith("--") and "=" in arg:
        flag, value = arg.split("=", 1)
        return f"{flag}={portable_path(value)}"
    return portable_path(arg)


def cpu_line() -> str:
    """The host's CPUs as results quote them: count, affinity (what this run may use), model."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu}"

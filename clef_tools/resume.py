"""What an existing `clef-batch` output already holds, so a rerun answers only the rest.

A run stopped by SIGINT, SIGKILL, a crash or a power cut leaves its output with whole lines and
at most one torn last line (lines are appended whole, see `batch_output`). The torn line is cut
off, so appending continues on a line boundary; every whole line names a custom_id (or, for an
input line whose custom_id could not be read, its line number) that is then skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path


class ResumeError(Exception):
    """The output file is not a clef-batch output; str() says which line and why."""


@dataclass
class Done:
    """The custom_ids and the unkeyed input line numbers the output already answers."""

    custom_ids: set[str] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)
    torn_bytes: int = 0  # how much of a torn last line was cut off

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)


def _key(record: object) -> tuple[str | None, int | None]:
    """(custom_id, line) of one output record; ValueError if it is not one."""
    if not isinstance(record, dict) or "custom_id" not in record:
        raise ValueError("not an object with a custom_id")
    custom_id = record["custom_id"]
    if isinstance(custom_id, str):
        return custom_id, None
    error = record.get("error")
    line = error.get("line") if isinstance(error, dict) else None
    if custom_id is None and isinstance(line, int):
        return None, line
    raise ValueError("neither a custom_id nor an input line number")


def load_done(path: Path) -> Done:
    """Read `path` (missing: nothing done), cut a torn last line off it, list what it answers."""
    done = Done()
    if not path.exists():
        return done
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        done.torn_bytes = len(data) - end
        os.truncate(path, end)
    for number, raw in enumerate(data[:end].splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            custom_id, line = _key(json.loads(raw))
        except ValueError as exc:
            raise ResumeError(f"{path} line {number} is not a clef-batch output line ({exc}); "
                              "not appending to it") from None
        if custom_id is not None:
            done.custom_ids.add(custom_id)
        elif line is not None:
            done.lines.add(line)
    return done

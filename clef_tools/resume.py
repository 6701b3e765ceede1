"""What an existing `clef-batch` output already holds, so a rerun answers only the rest.

A run stopped by SIGINT, SIGKILL, a crash or a power cut leaves its output with whole lines and
at most one torn last line (lines are appended whole, see `batch_output`). The torn line is cut
off, so appending continues on a line boundary; every whole line names a custom_id (or, for an
input line whose custom_id could not be read, its line number) that is then skipped.

Each answered line also names the weights that scored it (`weights`, batch_output): a rerun
after the model or a checkpoint changed would otherwise mix two models' answers in one file
without a trace, so once its workers are ready the run compares (`other_weights`) and stops
unless told to append under other weights (`--resume-other-weights`).
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
    # The fingerprints of the weights that scored the lines there (the non-null `weights`).
    weights: set[str] = field(default_factory=set)

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
            record = json.loads(raw)
            custom_id, line = _key(record)
        except ValueError as exc:
            raise ResumeError(f"{path} line {number} is not a clef-batch output line ({exc}); "
                              "not appending to it") from None
        weights = record.get("weights")
        if isinstance(weights, str) and weights:
            done.weights.add(weights)
        if custom_id is not None:
            done.custom_ids.add(custom_id)
        elif line is not None:
            done.lines.add(line)
    return done


def other_weights(done: Done, served: set[str], path: Path) -> str | None:
    """Why appending to `path` would mix weights (its lines were scored by weights none of
    which the workers serve now: the base's fingerprint or a variant's), or None."""
    foreign = sorted(done.weights - served)
    if not foreign:
        return None
    return (f"{path} holds answers scored by other weights ({', '.join(w[:16] for w in foreign)}"
            f"; the workers now serve {', '.join(sorted(w[:16] for w in served)) or 'none'}): "
            "not appending to it, so no file mixes two models' answers unmarked; give "
            "--resume-other-weights to append anyway (each line keeps its own `weights`) or "
            "write to a new --output")

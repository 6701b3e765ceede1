"""`--finetune NAME=CHECKPOINT` and `--finetune DIRECTORY`: the fine-tuned variants to serve.

One owner for what the flag means, read by the front (the names it routes and lists), the worker
(what it loads) and clef-batch. No torch and no file contents here: a value names checkpoints,
the worker checks what they hold (clef_worker.variants).

- `NAME=CHECKPOINT`: the clef-finetune checkpoint directory `CHECKPOINT` (`adapter/`,
  `joint_head.safetensors`, ...) served as model `NAME`;
- `DIRECTORY` (no `=`): every subdirectory holding `adapter/adapter_config.json`, each served
  under its directory name (`runs/x/checkpoint-1000` is itself one checkpoint: give it a name).
  What the directory holds is read again on every worker start and roll: an entry that cannot
  be served (named like the base, a name given twice, unreadable) is refused on its own, the
  rest is served, and an empty directory serves the base alone.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

# The names a model may have: one URL path segment as sent (the catalogue's rule, kept here so
# the flag's parser needs no front module).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
ADAPTER_CONFIG = Path("adapter") / "adapter_config.json"


@dataclass(frozen=True)
class Finetune:
    """One served variant: its model name and its checkpoint directory."""

    name: str
    checkpoint: Path


def finetune_arg(value: str) -> str:
    """argparse type: the value's syntax only (a name that fits a path segment); directories are
    expanded by `resolve_finetunes`, once every value is known."""
    name, sep, path = value.partition("=")
    if sep and not MODEL_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"--finetune {value}: {name!r} is not a usable model name: letters, digits, '.', "
            "'_', ':' and '-', starting with a letter or digit, at most 128 characters")
    if (sep and not path) or not value:
        raise argparse.ArgumentTypeError(f"--finetune {value!r}: expected NAME=CHECKPOINT or a "
                                         "directory of checkpoints")
    return value


@dataclass(frozen=True)
class Refusal:
    """A `--finetune` value, or one entry of a directory it names, that serves no variant.

    `in_directory`: an entry found in a directory of checkpoints (entries come and go between
    a start and the next roll, so one is refused and the rest served); otherwise the value
    itself is wrong (a flag error: the front refuses to start on it)."""

    value: str
    reason: str
    in_directory: bool

    def __str__(self) -> str:
        return f"--finetune {self.value}: {self.reason}"


def scan_finetunes(values: list[str] | None, served: tuple[str, ...] = ()
                   ) -> tuple[list[Finetune], list[Refusal]]:
    """Every variant the values name now, in order, and what was refused, never raising.

    `served` are the base's names (served name, aliases, the model id): a checkpoint named
    like one of them would take the base's name over, so it is refused, as is a name given
    twice (the first is kept), a directory entry whose name is no usable model name, a
    checkpoint directory that is gone. A directory with no checkpoint in it serves none (the
    base alone): removing the last checkpoint is not a reason to stop serving."""
    found: list[Finetune] = []
    refused: list[Refusal] = []
    taken: set[str] = set(served)
    for value in values or ():
        name, sep, path = value.partition("=")
        if sep:
            checkpoint = Path(path).expanduser()
            candidates = [(name, checkpoint, False)]
            if not checkpoint.is_dir():
                refused.append(Refusal(value, f"{checkpoint} is not a directory", False))
                continue
        else:
            directory = Path(value).expanduser()
            if not directory.is_dir():
                refused.append(Refusal(value, "no such directory of checkpoints", False))
                continue
            candidates = []
            try:
                children = sorted(directory.iterdir())
            except OSError as exc:
                refused.append(Refusal(value, f"cannot list the directory: {exc}", False))
                continue
            for child in children:
                try:
                    holds = (child / ADAPTER_CONFIG).is_file()
                except OSError as exc:
                    refused.append(Refusal(value, f"{child.name}: unreadable ({exc})", True))
                    continue
                if holds:
                    candidates.append((child.name, child, True))
        for candidate, checkpoint, in_directory in candidates:
            where = f"{candidate!r}" if not in_directory else f"{checkpoint.name}: {candidate!r}"
            if not MODEL_NAME.fullmatch(candidate):
                refused.append(Refusal(value, f"{where} is not a usable model name; give it "
                                              "one with NAME=CHECKPOINT", in_directory))
            elif candidate in served:
                refused.append(Refusal(value, f"{where} is already a served model name (the "
                                              "base's): refused, the base keeps its name",
                                       in_directory))
            elif candidate in taken:
                entry = f"{checkpoint.name}: " if in_directory else ""
                refused.append(Refusal(value, f"{entry}the name {candidate!r} is given twice "
                                              "(the first is served)", in_directory))
            else:
                taken.add(candidate)
                found.append(Finetune(candidate, checkpoint.resolve()))
    return found, refused


def resolve_finetunes(values: list[str] | None, served: tuple[str, ...] = ()) -> list[Finetune]:
    """`scan_finetunes` for the front's start and clef-batch: ValueError for the first value
    that is itself wrong (a missing directory or checkpoint, an explicit name clashing with a
    served name or given twice); a directory's refused entries are left out (the worker logs
    each one on every start and roll)."""
    found, refused = scan_finetunes(values, served)
    for refusal in refused:
        if not refusal.in_directory:
            raise ValueError(str(refusal))
    return found

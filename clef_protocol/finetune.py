"""`--finetune NAME=CHECKPOINT` and `--finetune DIRECTORY`: the fine-tuned variants to serve.

One owner for what the flag means, read by the front (the names it routes and lists), the worker
(what it loads) and clef-batch. No torch and no file contents here: a value names checkpoints,
the worker checks what they hold (clef_worker.variants).

- `NAME=CHECKPOINT`: the clef-finetune checkpoint directory `CHECKPOINT` (`adapter/`,
  `joint_head.safetensors`, ...) served as model `NAME`;
- `DIRECTORY` (no `=`): every subdirectory holding `adapter/adapter_config.json`, each served
  under its directory name (`runs/x/checkpoint-1000` is itself one checkpoint: give it a name).
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


def resolve_finetunes(values: list[str] | None, served: tuple[str, ...] = ()) -> list[Finetune]:
    """Every variant the values name, in order; ValueError says which value is wrong (a missing
    directory, an empty directory of checkpoints, a name given twice or clashing with a served
    name or alias)."""
    found: list[Finetune] = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if sep:
            checkpoint = Path(path).expanduser()
            if not checkpoint.is_dir():
                raise ValueError(f"--finetune {value}: {checkpoint} is not a directory")
            found.append(Finetune(name, checkpoint.resolve()))
            continue
        directory = Path(value).expanduser()
        if not directory.is_dir():
            raise ValueError(f"--finetune {value}: no such directory of checkpoints")
        children = sorted(child for child in directory.iterdir()
                          if (child / ADAPTER_CONFIG).is_file())
        if not children:
            raise ValueError(f"--finetune {value}: no checkpoint in it (a subdirectory holding "
                             f"{ADAPTER_CONFIG})")
        for child in children:
            if not MODEL_NAME.fullmatch(child.name):
                raise ValueError(f"--finetune {value}: {child.name!r} is not a usable model "
                                 "name; give it one with NAME=CHECKPOINT")
            found.append(Finetune(child.name, child.resolve()))
    seen: set[str] = set()
    for variant in found:
        if variant.name in served:
            raise ValueError(f"--finetune: {variant.name!r} is already a served model name")
        if variant.name in seen:
            raise ValueError(f"--finetune: the name {variant.name!r} is given twice")
        seen.add(variant.name)
    return found

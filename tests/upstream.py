"""The release's own `joint_schema_model.py`, as the `clef-finetune` package ships it.

Tests compare this project with the real upstream file instead of a guess at it. The file is
never copied into the repository: `clef-finetune` (pinned in the `upstream` extra, installed
with `--no-deps` as the README's test set-up and .ci/run do) carries an unmodified copy, whose
SHA-256 its NOTICE gives together with the Cloudflare/clef revision it came from. A test that
needs the file copies it into a temporary snapshot, as a downloaded release would hold it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

from clef_worker.release import RELEASE_FILE

# clef_finetune/_vendor/NOTICE: joint_schema_model.py of Cloudflare/clef at revision
# 2f3de3dd85f379784083b0814d997ab627200f0c.
UPSTREAM_SHA256 = "0e304cf7c6500e8bb59bef7e2afd2c6373f82596dfb3b57d1aa93c175e2dc3a3"
UPSTREAM_PIN = "clef-finetune==0.1.0"
"""The `upstream` extra's one requirement (pyproject.toml; a test checks they agree)."""


def upstream_file() -> Path:
    """The installed copy; the test fails (not skips) without it, as the README's test set-up
    installs it."""
    spec = importlib.util.find_spec("clef_finetune")
    if spec is None or spec.origin is None:
        pytest.fail(f"clef-finetune is not installed: pip install --no-deps {UPSTREAM_PIN} (the "
                    "`upstream` extra; it carries the release's joint_schema_model.py)")
    path = Path(spec.origin).parent / "_vendor" / "joint_schema_model.py"
    if not path.is_file():
        pytest.fail(f"{path} is missing from the installed clef-finetune")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@cache
def upstream_module() -> ModuleType:
    """The upstream file imported once, for its constants and helpers (not for serving)."""
    path = upstream_file()
    name = "_clef_upstream_reference"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def release_snapshot(source: Path, directory: Path) -> Path:
    """A copy of the snapshot at `source` holding the release's file, as a downloaded release
    holds it."""
    shutil.copytree(source, directory)
    shutil.copyfile(upstream_file(), directory / RELEASE_FILE)
    return directory


class TextOnlyProcessor:
    """What the release's processor is to a text-only request: its tokenizer (transformers'
    `AutoTokenizer` for the snapshot, the one `AutoProcessor` would hold). The whole processor
    needs torchvision built for the installed torch, which the CPU wheel lacks; a media request
    through this one fails."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("media needs the release's processor (torchvision)")


def use_text_only_processor(patch: pytest.MonkeyPatch) -> None:
    """Make the release's `AutoProcessor.from_pretrained` build a `TextOnlyProcessor`."""
    from transformers import AutoProcessor

    patch.setattr(AutoProcessor, "from_pretrained", TextOnlyProcessor)

"""docs/operations.md's flag tables are checked against `clef-serve`'s own parser: every flag the
parser defines has a row, every row names a real flag, and every default a row states is the
parser's default (a flag with no default, None, must not be documented with a value)."""

from __future__ import annotations

import argparse
import re

import pytest

from clef_frontend.cli import build_parser
from tests.conftest import REPO

OPERATIONS = REPO / "docs" / "operations.md"


def flag_rows() -> list[tuple[list[str], str]]:
    """(flags, default cell) of every row of the tables under "## Flags"."""
    text = OPERATIONS.read_text(encoding="utf-8")
    section = text[text.index("\n## Flags\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `--"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows.append((re.findall(r"`(--[a-z0-9-]+)", cells[0]), cells[1]))
    return rows


def options() -> dict[str, argparse.Action]:
    return {option: action for action in build_parser()._actions
            for option in action.option_strings if option.startswith("--")}


def as_text(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def stated(cell: str) -> str:
    """The value a default cell starts with: `auto`, 16384, 10 s, 0: by device ... -> its first
    word without quotes or units."""
    return re.split(r"[\s:(]", cell.replace("`", "").strip(), maxsplit=1)[0]


def test_every_flag_has_a_row_and_every_row_a_flag() -> None:
    documented = {flag for flags, _ in flag_rows() for flag in flags}
    defined = set(options()) - {"--help"}
    assert sorted(defined - documented) == [], "flags missing from docs/operations.md"
    assert sorted(documented - defined) == [], "rows for flags the parser does not have"


def _pairs() -> list[tuple[str, str]]:
    """(flag, its default as the row states it), where a row states one per flag."""
    pairs: list[tuple[str, str]] = []
    for flags, cell in flag_rows():
        parts = [cell] if len(flags) == 1 else re.split(r",\s*|\s+/\s+", cell)
        if len(parts) == len(flags):
            pairs += zip(flags, parts, strict=True)
    return pairs


@pytest.mark.parametrize(("flag", "cell"), _pairs())
def test_the_stated_default_is_the_parser_s(flag: str, cell: str) -> None:
    action = options()[flag]
    if action.nargs == 0:  # --version: an action, no value
        return
    if action.default in (None, []):
        assert not re.match(r"`?\d", cell), f"{flag} has no default, the doc says {cell!r}"
    else:
        assert stated(cell) == as_text(action.default), (flag, cell, action.default)


def test_the_check_can_fail() -> None:
    assert stated("`auto`") == "auto" and stated("10 s") == "10"
    assert stated("0: by device, 16 on a CUDA worker") == "0"
    assert stated("67108864 (64 MiB)") == "67108864"
    assert as_text(30.0) == "30" and as_text(0.5) == "0.5"
    assert len(_pairs()) >= 40

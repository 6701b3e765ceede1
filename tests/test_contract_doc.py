"""docs/http-contract.md says what the code sends: its rows are numbered in order, and every
fixed detail text in its tables is a string the serving packages actually hold."""

from __future__ import annotations

import ast
import re
from functools import cache

from tests.conftest import REPO

CONTRACT = REPO / "docs" / "http-contract.md"


def _table_rows() -> list[list[str]]:
    rows = []
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


@cache
def _code_strings() -> frozenset[str]:
    """Every string constant in the packages that answer HTTP requests (f-strings' fixed parts
    too): the front, the request rules below both drivers, dispatch and the protocol."""
    found: set[str] = set()
    for package in ("clef_frontend", "clef_api", "clef_dispatch", "clef_protocol"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return frozenset(found)


def test_the_numbered_rows_are_1_to_14_in_order() -> None:
    numbers = [int(row[0]) for row in _table_rows() if row[0].isdigit()]
    assert numbers == list(range(1, 15))


def test_every_fixed_detail_is_one_the_code_sends() -> None:
    details = []
    for row in _table_rows():
        if row[-1] == "detail" or len(row) < 3 or not row[-2].isdigit():
            continue  # the header rows, and the route table (no status column)
        details += [text for text in re.findall(r"`([^`]+)`", row[-1].split(", with")[0])
                    if "{" not in text]
    assert len(details) >= 18
    missing = [text for text in details if text not in _code_strings()]
    assert missing == []

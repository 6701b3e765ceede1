"""docs/architecture.md's dispatch table and clef_dispatch/__init__'s list the package's real
modules, each once, no more and no fewer."""

from __future__ import annotations

import re
from pathlib import Path

import clef_dispatch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clef_dispatch"
ROW = re.compile(r"^\| `(\w+\.py)` \|", re.MULTILINE)


def _modules() -> list[str]:
    return sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def _dispatch_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("Dispatch (`clef_dispatch/`)")
    end = text.index("Operators' tools", start)
    return text[start:end]


def test_the_architecture_table_lists_every_dispatch_module_once() -> None:
    rows = ROW.findall(_dispatch_section())
    assert sorted(rows) == _modules()


def test_the_package_docstring_lists_every_module_once() -> None:
    rows = ROW.findall(clef_dispatch.__doc__ or "")
    assert sorted(rows) == _modules()

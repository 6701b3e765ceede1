"""docs/architecture.md's dispatch table and clef_dispatch/__init__'s list the package's real
modules, each once, no more and no fewer; its worker table lists every worker module."""

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


def test_the_architecture_table_lists_every_worker_module() -> None:
    """The worker's table (docs/architecture.md, "Worker (`clef_worker/`)") names every module
    of the worker's packages by its path inside `clef_worker/` (`demo/` by its directory)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("Worker (`clef_worker/`)")
    section = text[start:text.index("Helpers for benchmarks", start)]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", section, re.MULTILINE))
    worker = ROOT / "clef_worker"
    modules = {path.relative_to(worker).as_posix() for path in worker.rglob("*.py")
               if path.name not in ("__init__.py", "__main__.py")}
    assert modules - listed == set()
    assert listed - modules == set()

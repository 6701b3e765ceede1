"""The packages' layers, read from the code's own imports: clef_dispatch and clef_tools import
nothing of clef_frontend; the front, the tools and clef_api reach clef_dispatch only through its
package (its door, never its modules); the drivers run the request checks only through
`RequestRules`' stages; no clef_dispatch module is over 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 450


def _imports(package: str) -> list[tuple[Path, str]]:
    """(file, imported module) for every import in `package`'s files."""
    found = []
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((path, node.module))
            elif isinstance(node, ast.Import):
                found.extend((path, alias.name) for alias in node.names)
    return found


def test_dispatch_and_tools_import_nothing_of_the_front() -> None:
    for package in ("clef_dispatch", "clef_tools", "clef_api"):
        wrong = [(p.name, m) for p, m in _imports(package) if m.split(".")[0] == "clef_frontend"]
        assert not wrong, (package, wrong)


def test_the_drivers_reach_dispatch_only_through_its_package() -> None:
    for package in ("clef_frontend", "clef_tools", "clef_api"):
        wrong = [(p.name, m) for p, m in _imports(package) if m.startswith("clef_dispatch.")]
        assert not wrong, (package, wrong)


def test_the_drivers_run_the_request_checks_only_through_their_stages() -> None:
    """clef_api.checks owns the checks' order: a driver takes `RequestRules` (and constants)
    from it, never a single check it could compose in an order of its own."""
    allowed = {"RequestRules", "DEFAULT_BODY_LIMIT", "JSON_MEDIA_TYPE"}
    for package in ("clef_frontend", "clef_tools"):
        taken: set[str] = set()
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "clef_api.checks":
                    taken.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module == "clef_api":
                    assert "checks" not in {alias.name for alias in node.names}, path
        assert "RequestRules" in taken and taken <= allowed, (package, taken)


def test_no_dispatch_module_is_over_450_lines() -> None:
    sizes = {path.name: len(path.read_text().splitlines())
             for path in (REPO / "clef_dispatch").glob("*.py")}
    assert sizes and max(sizes.values()) <= MAX_LINES, sizes

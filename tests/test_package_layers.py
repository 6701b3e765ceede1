"""The packages' layers, read from the code's own imports: clef_dispatch and clef_tools import
nothing of clef_frontend; the front, the tools and clef_api reach clef_dispatch only through its
package (its door, never its modules); the drivers run the request checks only through
`RequestRules`' stages; no clef_dispatch module is over 450 lines; no import cycle among the
installed packages' modules."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Mapping
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


# -- import cycles ---------------------------------------------------------------------------------


def _installed_packages() -> list[str]:
    """The top-level packages pyproject.toml installs (its `packages.find` include list), so a
    package added there is checked without touching this test, and benchlib (the helpers of
    bench/, stress/ and tests/, shipped in the sdist but not installed)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").split(".")[0] for pattern in include} | {"benchlib"})


def _module_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module name -> the project modules it imports, for `packages` under `root`.

    Every import counts, wherever it stands (in a function, under TYPE_CHECKING): an import
    moved into a function to dodge a cycle still ties the two modules to each other. A name
    imported from a package counts as its submodule when it is one (`from clef_worker import
    policy`), else as the package's `__init__`; relative imports are resolved."""
    files: dict[str, Path] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path

    def known(name: str) -> str | None:
        """The project module `name` lives in (its longest prefix that is one)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(filter(None, (known(alias.name) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets.update(filter(None, (known(f"{base}.{alias.name}")
                                             for alias in node.names)))
        graph[name] = targets - {name}
    return graph


def _a_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as the path that closes it (a, b, ..., a), or None: a depth-first walk
    that meets a module still on its own path has found one."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        todo = [iter(sorted(graph[start]))]
        while todo:
            following = next(todo[-1], None)
            if following is None:  # every import of path[-1] walked: no cycle through it
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                todo.pop()
                continue
            if following in on_path:
                return [*path[path.index(following):], following]
            if following not in done and following in graph:
                path.append(following)
                on_path.add(following)
                todo.append(iter(sorted(graph[following])))
    return None


def test_the_cycle_finder_names_a_cycle_and_passes_a_tree() -> None:
    """What the check below relies on: a cycle, even one reached from outside it, is named as
    its closing path; a diamond (two ways to one module) is no cycle."""
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}) == ["b", "c", "b"]
    assert _a_cycle({"x": {"y", "z"}, "y": {"w"}, "z": {"w"}, "w": set()}) is None


def test_a_cycle_through_relative_lazy_and_submodule_imports_is_named(tmp_path: Path) -> None:
    """The graph's edges, on a package written for the test: a relative import, one inside a
    function, and a submodule imported by name from its package close a cycle, named in order.
    `from pkg import c` ties `b` to the submodule `c`, not to the package's `__init__` (which
    imports `a`: counted as the package's own edge, it would make a second, false cycle)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from .sub.b import B\nA = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg import c\nB = 2\n")
    (package / "c.py").write_text("import os\nimport pkg.a\n")
    graph = _module_graph(tmp_path, ["pkg"])
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert _a_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (package / "c.py").write_text("import os\n")
    assert _a_cycle(_module_graph(tmp_path, ["pkg"])) is None


def test_no_import_cycle_among_the_packages() -> None:
    packages = _installed_packages()
    assert "clef_dispatch" in packages and "clef_worker" in packages
    graph = _module_graph(REPO, packages)
    assert "clef_dispatch.worker_process" in graph["clef_dispatch.worker_channel"]
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# -- the worker's house: the process over two wings over the model ------------------------------

# Each group of the worker imports only the groups after it: the process (frames, loading, the
# executors) over the start-up wing over the serving wing over the model. docs/architecture.md's
# worker table is laid out in the same order.
PROCESS = ("main", "stdio", "parent", "loading", "assembly", "native", "release")
WORKER_FLOORS = (
    ("process", PROCESS),
    ("starting", ("starting",)),
    ("serving", ("serving",)),
    ("model", ("model", "media")),
)


def _worker_group(module: str) -> str | None:
    """The worker group a dotted module belongs to (None: a shared room, such as `errors`)."""
    parts = module.split(".")
    if parts[0] != "clef_worker" or len(parts) < 2:
        return None
    return next((name for name, roots in WORKER_FLOORS if parts[1] in roots), None)


def test_the_worker_imports_only_downwards() -> None:
    order = [name for name, _ in WORKER_FLOORS]
    wrong = []
    for path, imported in _imports("clef_worker"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mine, theirs = _worker_group(module), _worker_group(imported)
        if mine and theirs and order.index(theirs) < order.index(mine):
            wrong.append((module, imported))
    assert not wrong, wrong


def test_the_house_rule_catches_an_import_up_a_floor() -> None:
    assert _worker_group("clef_worker.serving.runner") == "serving"
    assert _worker_group("clef_worker.starting.warmup") == "starting"
    assert _worker_group("clef_worker.model.head") == "model"
    assert _worker_group("clef_worker.errors") is None


def test_no_worker_module_is_over_450_lines() -> None:
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
             for path in (REPO / "clef_worker").rglob("*.py")}
    assert sizes and {name: n for name, n in sizes.items() if n > MAX_LINES} == {}

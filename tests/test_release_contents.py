"""What the built distributions hold: the sdist is a complete source release (every file of the
test suite, its fixtures and helpers, the docs, the deployment files, the benchmarks and the
reliability suite with their helper layer, the CI script), and the wheel installs only the
serving packages, each with its `py.typed`, and the commit it was built from.

Built here with `python -m build` (the test extra installs it), from this tree: a checkout or an
unpacked sdist alike (CI runs the suite from the latter, so the sdist is checked to rebuild
itself).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from clef_protocol import build_info
from tests.conftest import REPO

# Folders the sdist carries whole (MANIFEST.in's grafts), beside the packages.
GRAFTED = ("tests", "docs", "deploy", "bench", "stress", "benchlib", ".ci")
# What a working tree holds that is no part of a release.
LITTER = {"__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}


def packages() -> list[str]:
    """The installed top-level packages, as pyproject.toml's find.include names them."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(pattern.rstrip("*") for pattern in include)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def sdist_names(dist: Path) -> set[str]:
    [archive] = dist.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def wheel_names(dist: Path) -> set[str]:
    [archive] = dist.glob("*.whl")
    with zipfile.ZipFile(archive) as wheel:
        return set(wheel.namelist())


def tree_files(folder: str) -> set[str]:
    return {str(path.relative_to(REPO)) for path in (REPO / folder).rglob("*")
            if path.is_file() and not LITTER & set(path.relative_to(REPO).parts)
            and path.suffix != ".pyc"}


def test_the_packages_are_the_serving_ones() -> None:
    assert packages() == ["clef_api", "clef_dispatch", "clef_frontend", "clef_protocol",
                          "clef_tools", "clef_worker"]


def test_the_sdist_carries_every_file_of_the_source_release(dist: Path) -> None:
    names = sdist_names(dist)
    wanted = set().union(*(tree_files(folder) for folder in (*GRAFTED, *packages())))
    assert {"tests/conftest.py", "tests/fixtures/clef-tiny.golden.jsonl",
            "tests/fixtures/clef-tiny/config.json", "benchlib/paths.py", ".ci/run",
            "docs/benchmarks.md", "README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml",
            "setup.py", "MANIFEST.in"} <= names
    assert sorted(wanted - names) == []
    assert not any(LITTER & set(Path(name).parts) or name.endswith(".pyc") for name in names)


def test_the_wheel_installs_the_serving_packages_typed_and_nothing_else(dist: Path) -> None:
    names = wheel_names(dist)
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == set(packages())  # no benchlib, tests, bench or stress
    for package in packages():
        assert f"{package}/py.typed" in names


def test_both_record_the_commit_they_were_built_from(dist: Path) -> None:
    [archive] = dist.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(f"/{build_info.BUILD_COMMIT}")
                      and m.name.count("/") == 1)
        handle = tar.extractfile(member)
        assert handle is not None
        in_sdist = handle.read().decode().strip()
    [wheel] = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive_:
        in_wheel = archive_.read(f"clef_protocol/{build_info.BUILD_COMMIT}").decode().strip()
    expected = build_info.git_commit(REPO) or build_info.recorded_commit(REPO)
    assert in_sdist == in_wheel == expected

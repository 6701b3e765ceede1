"""Under CI a skip is a failure unless its reason is the GPU (tests/ci_policy.py): the session
check turns a run red, and .ci/run installs every tool a test looks for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci_policy import GPU_ONLY, SOURCES, missing, not_allowed
from tests.conftest import REPO

CONFTEST = """
from tests.ci_policy import pytest_runtest_logreport as pytest_runtest_logreport
from tests.ci_policy import pytest_sessionfinish as pytest_sessionfinish
from tests.ci_policy import pytest_terminal_summary as pytest_terminal_summary
"""

TESTS = f"""
import pytest

def test_passes():
    assert True

@pytest.mark.skipif(True, reason={GPU_ONLY!r})
def test_needs_a_gpu():
    pass

def test_skips_for_a_tool():
    pytest.skip("wrk is not installed")

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
    assert False
"""


def _session(tmp_path: Path, tests: str, ci: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_sample.py").write_text(tests)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120, check=False)


def test_under_ci_a_skip_for_anything_but_the_gpu_fails_the_run(tmp_path: Path) -> None:
    result = _session(tmp_path, TESTS, ci=True)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    assert "skips that fail a CI run" in result.stdout
    assert "test_skips_for_a_tool: wrk is not installed" in result.stdout
    assert "test_needs_a_gpu:" not in result.stdout  # the GPU skip is allowed, not listed


def test_under_ci_the_gpu_skip_alone_passes(tmp_path: Path) -> None:
    tests = TESTS.replace('pytest.skip("wrk is not installed")', "pass")
    result = _session(tmp_path, tests, ci=True)
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "skips that fail a CI run" not in result.stdout


def test_locally_a_skip_is_a_skip(tmp_path: Path) -> None:
    result = _session(tmp_path, TESTS, ci=False)
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "2 skipped" in result.stdout


def test_a_failing_run_stays_failed(tmp_path: Path) -> None:
    result = _session(tmp_path, TESTS + "\ndef test_fails():\n    assert False\n", ci=True)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout


def test_only_the_gpu_reason_is_allowed() -> None:
    assert not_allowed([("a", GPU_ONLY), ("b", "nginx is not installed")]) == \
        [("b", "nginx is not installed")]


def test_a_missing_tool_fails_under_ci_and_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"nginx is not installed; \.ci/run installs"):
        missing("nginx is not installed")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="nginx is not installed"):
        missing("nginx is not installed")


def test_ci_installs_every_tool_the_tests_look_for() -> None:
    """Each tool's package, named in SOURCES, is what .ci/run installs (apt or pip)."""
    ci = (REPO / ".ci" / "run").read_text()
    for tool, source in SOURCES.items():
        package = re.search(r"`([^`]+)`", source)
        assert package, f"SOURCES[{tool!r}] must name its package in backquotes"
        assert re.search(rf"(packages\+=\(|TOOLS=\([^)]*){re.escape(package[1])}\b", ci), \
            f".ci/run does not install {package[1]} (for {tool})"

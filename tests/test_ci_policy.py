"""Under CI a skip is a failure unless its reason is the GPU (tests/ci_policy.py): the session
check turns a run red, and .ci/run installs every tool a test looks for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.ci_policy import GPU_ONLY, SOURCES, missing, not_allowed
from tests.conftest import REPO

# The generated sessions' conftest: the project's own wiring of the policy, the lines of
# tests/conftest.py that import its hooks, so a hook that conftest stops wiring fails here too.
CONFTEST = "\n".join(line for line in (REPO / "tests" / "conftest.py").read_text().splitlines()
                      if line.startswith("from tests.ci_policy import pytest_")) + "\n"

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


def _session(tmp_path: Path, tests: str | dict[str, str],
             ci: bool) -> subprocess.CompletedProcess[str]:
    """pytest run in a subprocess on generated test files (a text, or {module name: text}) with
    the project's conftest policy."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    modules = tests if isinstance(tests, dict) else {"test_sample": tests}
    for name, text in modules.items():
        (tmp_path / f"{name}.py").write_text(text)
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


def test_the_generated_conftest_wires_every_hook_of_the_policy() -> None:
    hooks = {"pytest_collectreport", "pytest_itemcollected", "pytest_runtest_logreport",
             "pytest_sessionfinish", "pytest_terminal_summary"}
    assert {hook for hook in hooks if f"import {hook} as {hook}" in CONFTEST} == hooks


PASSING = "def test_passes():\n    assert True\n"

# Holes a run used to pass through: each module is skipped at collection, or its xfail is not
# strict, so its test's outcome is never checked.
AT_COLLECTION = {
    "test_ok": PASSING,
    "test_importorskip": "import pytest\n"
                         "pytest.importorskip('clef_no_such_module')\n" + PASSING,
    "test_module_skip": "import pytest\n"
                        "pytest.skip('wrk is not installed', allow_module_level=True)\n" + PASSING,
    "test_loose_xfail": "import pytest\n\n"
                        "@pytest.mark.xfail(reason='flaky on CI')\n"
                        "def test_may_fail():\n    assert False\n",
    "test_loose_xpass": "import pytest\n\n"
                        "@pytest.mark.xfail(reason='was broken once')\n"
                        "def test_now_passes():\n    assert True\n",
    "test_imperative_xfail": "import pytest\n\n"
                             "def test_gives_up():\n    pytest.xfail('not today')\n",
}

# What CI allows: a module skipped for the GPU, a strict xfail, an xfail whose reason is the GPU.
ALLOWED = {
    "test_ok": PASSING,
    "test_gpu_module": f"import pytest\npytest.skip({GPU_ONLY!r}, allow_module_level=True)\n"
                       + PASSING,
    "test_strict_xfail": "import pytest\n\n"
                         "@pytest.mark.xfail(reason='known', strict=True)\n"
                         "def test_known():\n    assert False\n",
    "test_gpu_xfail": f"import pytest\n\n@pytest.mark.xfail(reason={GPU_ONLY!r})\n"
                      "def test_on_gpu():\n    assert False\n",
}


def test_under_ci_skips_at_collection_and_loose_xfails_fail_the_run(tmp_path: Path) -> None:
    result = _session(tmp_path, AT_COLLECTION, ci=True)
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    refused = result.stdout[result.stdout.index("skips that fail a CI run"):]
    assert "test_importorskip.py: could not import 'clef_no_such_module'" in refused
    assert "test_module_skip.py: wrk is not installed" in refused
    assert "test_may_fail: xfail without strict=True: flaky on CI" in refused
    assert "test_now_passes: xfail without strict=True: was broken once" in refused
    assert "test_gives_up: xfail without strict=True: not today" in refused
    assert "test_ok" not in refused


def test_locally_skips_at_collection_and_xfails_pass(tmp_path: Path) -> None:
    result = _session(tmp_path, AT_COLLECTION, ci=False)
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "skips that fail a CI run" not in result.stdout


def test_under_ci_the_gpu_reason_and_strict_xfail_pass(tmp_path: Path) -> None:
    result = _session(tmp_path, ALLOWED, ci=True)
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "skips that fail a CI run" not in result.stdout
    assert "1 skipped" in result.stdout and "2 xfailed" in result.stdout


def test_ci_run_sets_ci_itself() -> None:
    """Run by hand, where no CI service sets the variable, .ci/run still refuses skips."""
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^export CI=true$", ci, flags=re.MULTILINE)
    assert ci.index("export CI=true") < ci.index("python -m pytest")


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
    """Each tool's package, named in SOURCES, is what .ci/run installs: a Debian package there, or
    a PyPI one in the `test` extra, which .ci/run installs (and so does the README's command)."""
    ci = (REPO / ".ci" / "run").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["test"]
    assert "pip install -q '.[test]'" in ci
    for tool, source in SOURCES.items():
        package = re.search(r"`([^`]+)`", source)
        assert package, f"SOURCES[{tool!r}] must name its package in backquotes"
        if source.startswith("PyPI"):
            assert any(re.fullmatch(rf"{re.escape(package[1])}(==[\w.]+)?", requirement)
                       for requirement in extra), f"the test extra lacks {package[1]} ({tool})"
        else:
            assert re.search(rf"packages\+=\({re.escape(package[1])}\)", ci), \
                f".ci/run does not install {package[1]} (for {tool})"

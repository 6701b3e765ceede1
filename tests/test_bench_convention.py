"""The benchmarks' `--quick` convention is enforced by `bench/run_quick.py` in CI: these tests
pin that its discovery covers every script in bench/, and that a quick mode deleted or broken
fails the run."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_quick import REPO, main, scripts
from benchlib.provenance import command_line, portable_path


def test_every_script_in_bench_is_discovered() -> None:
    on_disk = {path.name for path in (REPO / "bench").glob("*.py")} - {"run_quick.py"}
    assert {path.name for path in scripts()} == on_disk
    assert {"bench_executor.py", "bench_gpu_http.py", "gpu_parity.py"} <= on_disk


def test_ci_runs_every_quick_mode() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^python bench/run_quick\.py\s*$", ci, re.MULTILINE)


def _write(bench: Path, name: str, body: str) -> None:
    (bench / name).write_text("import argparse, sys\n" + body)


QUICK_OK = ("p = argparse.ArgumentParser(); p.add_argument('--quick', action='store_true')\n"
            "sys.exit(0 if p.parse_args().quick else 3)\n")


def test_a_quick_mode_deleted_or_broken_fails_the_run(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "bench_fine.py", QUICK_OK)
    assert main([], bench=tmp_path, timeout=60) == 0
    # deleted: argparse refuses the unknown flag (exit 2)
    _write(tmp_path, "bench_no_quick.py", "argparse.ArgumentParser().parse_args()\n")
    # broken: the quick path raises
    _write(tmp_path, "gpu_thing.py", "raise RuntimeError('the code path broke')\n")
    assert main([], bench=tmp_path, timeout=60) == 1
    err = capsys.readouterr().err
    assert "bench_no_quick.py" in err and "gpu_thing.py" in err and "bench_fine.py" not in err


def test_commands_in_results_carry_no_host_paths() -> None:
    line = command_line("bench/bench_x.py", ["--out", "/root/out/x.json", f"--model={REPO}/m",
                                             "--device", "cuda"])
    assert line == "python bench/bench_x.py --out x.json --model=m --device cuda"
    assert portable_path("relative/path") == "relative/path"


BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parent.parent))"


def _first_checkout_import(tree: ast.Module) -> int | None:
    """The line of the first module-level import of benchlib, tests or a project package."""
    for node in tree.body:
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                 else [alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [])
        if any(name.split(".")[0] in CHECKOUT_PACKAGES for name in names):
            return node.lineno
    return None


CHECKOUT_PACKAGES = {"benchlib", "tests", "clef_frontend", "clef_api", "clef_dispatch",
                     "clef_worker", "clef_protocol", "clef_tools"}


def test_scripts_import_the_checkout_s_code() -> None:
    """benchlib is not installed (the wheel leaves it out), so `python bench/<script>.py`, which
    puts bench/ on sys.path, not the root, finds it only through the root put there first; the
    same line makes a script measure this checkout's packages, not an installed copy."""
    missing = []
    for path in scripts():
        source = path.read_text()
        first = _first_checkout_import(ast.parse(source))
        if first is None:
            continue
        bootstrap = next((number for number, line in enumerate(source.splitlines(), 1)
                          if line.startswith(BOOTSTRAP)), None)
        if bootstrap is None or bootstrap > first:
            missing.append(path.name)
    assert missing == [], f"put `{BOOTSTRAP}` before the first import of benchlib, tests or " \
                          f"the packages in: {missing}"


def test_a_script_runs_from_a_tree_where_benchlib_is_not_installed(tmp_path: Path) -> None:
    """The bootstrap works where nothing but the tree provides benchlib: a copy of bench/ and
    benchlib/ elsewhere, run with the path of its script, no PYTHONPATH."""
    for name in ("bench", "benchlib"):
        shutil.copytree(REPO / name, tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    probe = tmp_path / "bench" / "probe.py"
    probe.write_text("import sys\nfrom pathlib import Path\n\n" + BOOTSTRAP + "\n\n"
                     "import benchlib.paths\n\nprint(benchlib.paths.REPO)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-I", str(probe)], capture_output=True, text=True,
                            cwd=tmp_path / "bench", env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == tmp_path.resolve()

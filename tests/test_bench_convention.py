"""The benchmarks' `--quick` convention is enforced by `bench/run_quick.py` in CI: these tests
pin that its discovery covers every script in bench/, and that a quick mode deleted or broken
fails the run."""

from __future__ import annotations

import re
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

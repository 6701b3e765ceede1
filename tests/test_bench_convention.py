"""Every benchmark script that `bench/run_quick.py` discovers takes `--quick` (bench/README.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.run_quick import REPO, scripts
from benchlib.provenance import command_line, portable_path


def test_the_known_scripts_are_discovered() -> None:
    names = {path.name for path in scripts()}
    assert {"bench_executor.py", "bench_flash_shaped.py", "bench_http.py",
            "gpu_parity.py"} <= names
    assert "run_quick.py" not in names and "provenance.py" not in names


@pytest.mark.parametrize("script", scripts(), ids=lambda path: path.name)
def test_every_benchmark_offers_quick(script: object) -> None:
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout


def test_commands_in_results_carry_no_host_paths() -> None:
    line = command_line("bench/bench_x.py", ["--out", "/root/out/x.json", f"--model={REPO}/m",
                                             "--device", "cuda"])
    assert line == "python bench/bench_x.py --out x.json --model=m --device cuda"
    assert portable_path("relative/path") == "relative/path"

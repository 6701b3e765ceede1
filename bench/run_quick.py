"""Run every benchmark script once in its quick mode; exit non-zero if any of them fails.

CI runs this after the tests (`.ci/run`), so a benchmark that no longer runs is noticed the day
it breaks rather than on the next GPU run. Discovery, not a list: every `bench/*.py` but this
runner is a benchmark script and is run as `python <script> --quick` in its own process, from
the repository root; helpers that are not benchmarks live in `benchlib/`. The convention every
such script follows (bench/README.md): `--quick` means tiny shapes, a few iterations, CPU, and
no writes (no docs; a result file only where `--out` names one). A script that lacks `--quick`
exits 2 (argparse), and one whose quick run breaks exits non-zero: either fails this run.

    python bench/run_quick.py            # all of them
    python bench/run_quick.py --list     # what would run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# Per script; a quick run that takes longer than this is itself a bug.
TIMEOUT_SECONDS = 900


def scripts(bench: Path = BENCH) -> list[Path]:
    """Every benchmark script in `bench`, in name order."""
    return sorted(path for path in bench.glob("*.py")
                  if path.is_file() and path.name != Path(__file__).name)


def main(argv: list[str] | None = None, bench: Path = BENCH,
         timeout: float = TIMEOUT_SECONDS) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the scripts and stop")
    args = parser.parse_args(argv)
    found = scripts(bench)
    if args.list:
        print("\n".join(path.name for path in found))
        return 0
    failed: list[str] = []
    for path in found:
        name = path.name
        print(f"=== {name} --quick", flush=True)
        started = time.monotonic()
        try:
            # stdout and stderr are inherited: nothing is buffered in a pipe nobody reads.
            code = subprocess.run([sys.executable, str(path), "--quick"], cwd=REPO,
                                  stdin=subprocess.DEVNULL, timeout=timeout,
                                  check=False).returncode
        except subprocess.TimeoutExpired:
            code = -1
        print(f"=== {name}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"quick benchmark runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(found)} quick benchmark runs passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

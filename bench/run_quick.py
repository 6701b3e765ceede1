"""Run every benchmark script once in its quick mode; exit non-zero if any of them fails.

CI runs this after the tests (`.ci/run`), so a benchmark that no longer runs is noticed the day
it breaks rather than on the next GPU lease. Discovery, not a list: every `bench/bench_*.py` and
`bench/gpu_parity.py` is run as `python <script> --quick` in its own process, from the
repository root. The convention every such script follows (bench/README.md): `--quick` means tiny
shapes, a few iterations, CPU, and no writes (no result file, no docs).

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
# Scripts that are not named bench_*.py but take --quick too.
EXTRA = ("gpu_parity.py",)
# Per script; a quick run that takes longer than this is itself a bug.
TIMEOUT_SECONDS = 900


def scripts() -> list[Path]:
    """Every benchmark script, in name order."""
    found = set(BENCH.glob("bench_*.py")) | {BENCH / name for name in EXTRA}
    return sorted(path for path in found if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the scripts and stop")
    args = parser.parse_args(argv)
    found = scripts()
    if args.list:
        print("\n".join(str(path.relative_to(REPO)) for path in found))
        return 0
    failed: list[str] = []
    for path in found:
        name = str(path.relative_to(REPO))
        print(f"=== {name} --quick", flush=True)
        started = time.monotonic()
        try:
            # stdout and stderr are inherited: nothing is buffered in a pipe nobody reads.
            code = subprocess.run([sys.executable, str(path), "--quick"], cwd=REPO,
                                  stdin=subprocess.DEVNULL, timeout=TIMEOUT_SECONDS,
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

"""Run every reliability scenario, one process each, and print one summary table.

`python -m stress.run_all --quick` is what `.ci/run` runs (under two minutes on 2 cores);
without `--quick` it is the full run whose figures docs/operations.md keeps. Each scenario is
still its own command (`python -m stress.NAME [--quick]`) for running alone.

Scenarios are discovered by name, as benchmarks are (`bench/run_quick.py`): every module
`stress/NAME.py` is a scenario, except this runner, `common.py` and any module whose name starts
with `_` (helpers). A scenario module defines `main(argv) -> int` (`stress.common.main_for`
builds it), accepts `--quick`, and exits 0 only when every check held. Adding
`stress/NAME.py` is all it takes to have CI run it; stress/README.md says the same.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

STRESS = Path(__file__).resolve().parent
REPO = STRESS.parent
# Modules of this folder that are not scenarios (helpers are named `_*.py`).
NOT_SCENARIOS = frozenset({"__init__", "common", "run_all"})
# A scenario that outlives this has hung; every loop inside is bounded well below it.
SCENARIO_LIMIT = 600.0


def scenarios() -> list[str]:
    """Every scenario's module name, in name order."""
    return sorted(path.stem for path in STRESS.glob("*.py")
                  if path.stem not in NOT_SCENARIOS and not path.stem.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    found = scenarios()
    parser = argparse.ArgumentParser(prog="python -m stress.run_all")
    parser.add_argument("--quick", action="store_true", help="the short CI run of each scenario")
    parser.add_argument("--only", nargs="+", choices=found, default=found,
                        help="run just these scenarios")
    parser.add_argument("--list", action="store_true", help="print the scenarios and stop")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(found))
        return 0
    results: list[tuple[str, str, float]] = []
    started = time.monotonic()
    for name in args.only:
        command = [sys.executable, "-m", f"stress.{name}", *(["--quick"] if args.quick else [])]
        began = time.monotonic()
        try:
            code = subprocess.run(command, cwd=REPO, timeout=SCENARIO_LIMIT).returncode
            outcome = "PASS" if code == 0 else f"FAIL (exit {code})"
        except subprocess.TimeoutExpired:
            outcome = f"FAIL (over {SCENARIO_LIMIT:g} s)"
        results.append((name, outcome, time.monotonic() - began))
    print(f"\n== reliability suite ({'quick' if args.quick else 'full'})")
    for name, outcome, seconds in results:
        print(f"  {name:<14} {outcome:<20} {seconds:6.1f} s")
    print(f"  {'total':<14} {'':<20} {time.monotonic() - started:6.1f} s")
    return 0 if all(outcome == "PASS" for _, outcome, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

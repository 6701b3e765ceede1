"""A worker's first start against its restart after a kill: `ready_s` and each phase, as the
worker reports them (`/health`'s `startup`, clef_worker.starting.startup_clock).

Not a test. Per round: `clef-serve` with the real worker on `--model` (default: the tiny test
snapshot) and a fresh cache directory (kernel cache, kept verdicts, digests), so the first start
has nothing kept; once it is ready, its worker is killed (SIGKILL) and the front starts a new one
on the same snapshot, code and device, which reuses what the first kept. Both `startup` maps and
whether the self-check was reused are recorded, per round, then the server is stopped.

    python bench/bench_startup.py --out bench/results/cpu-startup.json   # 3 rounds, tiny, CPU
    python bench/bench_startup.py --model /models/clef-flash --device cuda --rounds 1
    python bench/bench_startup.py --quick                                 # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.paths import TINY_SNAPSHOT
from benchlib.provenance import command_line, cpu_line
from benchlib.serve import Serve

READY_WAIT_S = 900.0  # a cold GPU start compiles every kernel


def one_round(model: str, device: str, extra: list[str]) -> dict[str, Any]:
    """One first start and one restart after a kill, on a cache directory of their own."""
    with tempfile.TemporaryDirectory(prefix="clef-startup-") as cache:
        env = {"CLEF_SERVE_CACHE": cache, "CLEF_SELF_CHECK_DIR": str(Path(cache) / "verdicts")}
        env.pop("TRITON_CACHE_DIR", None)
        with Serve(real_worker=True, startup_wait=READY_WAIT_S, env=env,
                   front_args=("--model", model, "--device", device, *extra)) as serve:
            first = serve.health().json()["worker"]
            os.kill(first["pid"], signal.SIGKILL)
            serve.wait_for(re.compile(rf"worker ready: .* pid=(?!{first['pid']}\b)\d+ "),
                           timeout=READY_WAIT_S)
            again = serve.health().json()["worker"]
    return {"first": _start(first), "restart": _start(again)}


def _start(worker: dict[str, Any]) -> dict[str, Any]:
    check = worker.get("self_check") or {}
    return {"startup": worker["startup"], "kernel_cache": worker.get("kernel_cache", ""),
            "self_check_reused": check.get("reused"), "self_check_ms": check.get("ms")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(TINY_SNAPSHOT))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: one round")
    args, extra = parser.parse_known_args()
    if args.quick:
        args.rounds = 1
    rounds = [one_round(args.model, args.device, extra) for _ in range(args.rounds)]
    summary = {
        name: {"ready_s": sorted(r[name]["startup"]["ready_s"] for r in rounds)[len(rounds) // 2],
               "self_check_reused": [r[name]["self_check_reused"] for r in rounds]}
        for name in ("first", "restart")}
    result = {"command": command_line("bench/bench_startup.py"), "cpus": cpu_line(),
              "model": Path(args.model).name, "device": args.device, "rounds": rounds,
              "median": summary,
              "restart_not_slower": all(r["restart"]["startup"]["ready_s"]
                                        <= r["first"]["startup"]["ready_s"] for r in rounds)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

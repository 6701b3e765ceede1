"""Compare the native executor on a given device/dtype/kernel with the golden answers.

Not a test (CI has no GPU): a check to run on a GPU host. The golden file was computed in float32
on CPU; float32 on CUDA should stay within the test tolerance (logits 1e-4), BF16 reports how far
it drifts (the release gates BF16 ports at 2e-3 to 1e-2 absolute probability, every argmax equal).
The golden cases are read and compared by `tests/golden.py`, the same loader and comparator the
tests use.

    python bench/gpu_parity.py --device cuda --dtype float32 --gdn-prefill torch
    python bench/gpu_parity.py --device cuda --dtype bfloat16 --gdn-prefill fla
    python bench/gpu_parity.py --device cuda --dtype bfloat16 --gdn-prefill fla --cuda-graphs on
    python bench/gpu_parity.py --quick      # CI: CPU float32, exits 1 outside the test tolerance
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from benchlib.golden import GOLDEN, Drift, load_cases
from benchlib.provenance import command_line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--fixtures", type=Path, default=GOLDEN.parent)
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="off",
                        help="on: length buckets (captured as CUDA graphs on CUDA, eager on CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU, float32, torch path; exit 1 unless within the test tolerance")
    args = parser.parse_args()
    if args.quick:
        args.device, args.dtype, args.gdn_prefill = "cpu", "float32", "torch"

    from clef_protocol.errors import RequestInvalid
    from clef_protocol.options import RequestLimits
    from clef_worker.native import NativeExecutor

    executor = NativeExecutor.load(args.fixtures / "clef-tiny", device=args.device,
                                   dtype=args.dtype, gdn_prefill=args.gdn_prefill,
                                   limits=RequestLimits(), cuda_graphs=args.cuda_graphs)
    if not args.quick:
        executor.warm_up()  # with --cuda-graphs on: every bucket captured before the cases run
    cases = load_cases(args.fixtures / GOLDEN.name)
    drift = Drift()
    ids_mismatch: list[str] = []
    error_mismatch: list[str] = []
    for case in cases:
        limited = executor.with_limits(dataclasses.replace(executor.limits,
                                                           max_length=case["max_length"]))
        if "error" in case:
            try:
                limited.score(case["request"])
            except RequestInvalid as exc:
                if str(exc) != case["error"]["message"]:
                    error_mismatch.append(case["name"])
            else:
                error_mismatch.append(case["name"])
            continue
        scored = limited.score(case["request"])
        if scored.encoding.input_ids != case["input_ids"]:
            ids_mismatch.append(case["name"])
        drift.add(case, scored.logits, scored.probabilities)
    info = executor.describe()
    summary: dict[str, Any] = {
        "command": command_line(__file__),
        "device": str(executor.device), "dtype": info.dtype, "gdn_path": info.gdn_path,
        "short_conv": info.short_conv,
        "cases": len(cases), "cuda_graphs": info.cuda_graphs,
        "buckets_captured": info.buckets_captured,
        "max_abs_logit_diff": drift.max_logit_diff,
        "max_abs_probability_diff": drift.max_probability_diff,
        "argmax_mismatches": drift.argmax_mismatches, "input_id_mismatches": ids_mismatch,
        "error_mismatches": error_mismatch,
        "within_test_tolerance": drift.within_tolerance and not ids_mismatch
        and not error_mismatch,
    }
    print(json.dumps(summary))
    if args.quick and not (summary["within_test_tolerance"] and cases):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

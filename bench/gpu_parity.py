"""Compare the native executor on a given device/dtype/kernel with the golden answers.

Not a test (CI has no GPU): a check to run on a GPU host. The golden file was computed in float32
on CPU; float32 on CUDA should stay within the test tolerance (logits 1e-4), BF16 reports how far
it drifts (the release gates BF16 ports at 2e-3 to 1e-2 absolute probability, every argmax equal).

    python bench/gpu_parity.py --device cuda --dtype float32 --gdn-prefill torch
    python bench/gpu_parity.py --device cuda --dtype bfloat16 --gdn-prefill fla
    python bench/gpu_parity.py --device cuda --dtype bfloat16 --gdn-prefill fla --cuda-graphs on
    python bench/gpu_parity.py --quick        # CPU smoke run: a few cases, buckets run eagerly
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--fixtures", type=Path, default=REPO.parent / "shared" / "fixtures")
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="off")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: float32, buckets on (eager), six cases, no warm-up")
    args = parser.parse_args()
    if args.quick:
        args.device, args.dtype, args.gdn_prefill, args.cuda_graphs = "cpu", "float32", \
            "torch", "on"

    from clef_protocol.options import RequestLimits
    from clef_protocol.validation import RequestInvalid
    from clef_worker.native import NativeExecutor

    executor = NativeExecutor.load(args.fixtures / "clef-tiny", device=args.device,
                                   dtype=args.dtype, gdn_prefill=args.gdn_prefill,
                                   limits=RequestLimits(), cuda_graphs=args.cuda_graphs)
    cases = [json.loads(line) for line in
             (args.fixtures / "clef-tiny.golden.jsonl").read_text().splitlines() if line]
    if args.quick:
        cases = cases[:6] + [case for case in cases if "error" in case][:2]
    else:
        executor.warm_up()  # in graphs mode: captures every bucket before the cases run
    worst_logit = worst_prob = 0.0
    argmax_mismatch: list[str] = []
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
        golden_logits = [x for q in case["questions"] for x in q["logits"]]
        golden_probs = [x for q in case["questions"] for x in q["probabilities"]]
        worst_logit = max(worst_logit, *(abs(a - b) for a, b in
                                         zip(scored.logits, golden_logits, strict=True)))
        worst_prob = max(worst_prob, *(abs(a - b) for a, b in
                                       zip(scored.probabilities, golden_probs, strict=True)))
        offset = 0
        for question in case["questions"]:
            n = len(question["probabilities"])
            mine = scored.probabilities[offset:offset + n]
            theirs = question["probabilities"]
            if mine.index(max(mine)) != theirs.index(max(theirs)):
                argmax_mismatch.append(f"{case['name']}/{question['id']}")
            offset += n
    summary: dict[str, Any] = {
        "device": str(executor.device), "dtype": executor.describe().dtype,
        "gdn_path": executor.describe().gdn_path, "cases": len(cases),
        "cuda_graphs": executor.describe().cuda_graphs,
        "buckets_captured": executor.describe().buckets_captured,
        "max_abs_logit_diff": worst_logit, "max_abs_probability_diff": worst_prob,
        "argmax_mismatches": argmax_mismatch, "input_id_mismatches": ids_mismatch,
        "error_mismatches": error_mismatch,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

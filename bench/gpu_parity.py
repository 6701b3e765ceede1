"""Compare the native executor on a given device/dtype/kernel with the golden answers, and
CUDA graphs with eager on the same cases.

Not a test (CI has no GPU): a check to run on a GPU host. The golden file was computed in float32
on CPU; float32 on CUDA should stay within the test tolerance (logits 1e-4), BF16 reports how far
it drifts (the release gates BF16 ports at 2e-3 to 1e-2 absolute probability, every argmax equal).
The golden cases are read and compared by `benchlib/golden.py`, the same loader and comparator
the tests use. The snapshot is loaded with media off (the cases are text; a vision tower would
only cost load time).

`--cuda-graphs both` loads the snapshot twice (eager, then bucketed with graphs), answers every
case with each, and compares them question by question (`graphs_vs_eager`: largest probability
difference, every argmax equal, the top-2 margins where an argmax differs). With graphs on, the
run exits 1 unless the executor reports every length bucket captured (benchlib/gpu_checks.py).
`packed_groups`: with each mode's executor, every answered case again in mixed groups of up to
eight (the batch layout's forwards: packed rows by default), compared with the same case alone,
question by question. Run on both executors, a difference is placed: grouped against alone on
the eager executor is the packed kernels (varlen against one sequence); the grouped answers of
the graphs executor against the eager one's (`packed_graphs_vs_packed_eager`, same layout and
kernels) is the capture. Against the golden answers (float32): `argmax_mismatches_vs_golden`
counts the questions whose argmax differs, over every mode.

The result is written to `--out` after each mode (a run stopped at its time limit keeps the
modes it finished; `"phase"` says how far it got).

The executor is loaded at the longest golden case's length (rounded up to 64, `--max-length 0`)
and a 4,096-token budget: every case fits, and only the shapes the cases can reach are
captured (not the 16,384-token table, which cost the old first sitting its time).

    python bench/gpu_parity.py --device cuda --dtype float32 --gdn-prefill torch
    python bench/gpu_parity.py --device cuda --dtype bfloat16 --gdn-prefill fla --cuda-graphs both
    python bench/gpu_parity.py --quick      # CI: CPU float32, exits 1 outside the test tolerance
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.golden import Drift, load_cases
from benchlib.gpu_checks import (
    capture_problems,
    capture_report,
    compare_questions,
    split_by_question,
)
from benchlib.paths import FIXTURES, GOLDEN
from benchlib.provenance import command_line


def run_cases(executor: Any, cases: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Every golden case through `executor`: drift from the golden values, mismatched token
    ids and refusals, and each answered case's probabilities per question."""
    from benchlib.executors import with_limits
    from clef_protocol.errors import RequestInvalid

    drift = Drift()
    ids_mismatch: list[str] = []
    error_mismatch: list[str] = []
    per_question: dict[str, list[list[float]]] = {}
    for case in cases:
        limited = with_limits(executor, dataclasses.replace(executor.limits,
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
        per_question[case["name"]] = split_by_question(
            scored.probabilities, [len(q.option_ids) for q in scored.encoding.questions])
    return {
        "max_abs_logit_diff": drift.max_logit_diff,
        "max_abs_probability_diff": drift.max_probability_diff,
        "argmax_mismatches": drift.argmax_mismatches, "input_id_mismatches": ids_mismatch,
        "error_mismatches": error_mismatch,
        "within_test_tolerance": drift.within_tolerance and not ids_mismatch
        and not error_mismatch,
        "per_question": per_question,
    }


def grouped_vs_alone(executor: Any, cases: tuple[dict[str, Any], ...],
                     alone: dict[str, list[list[float]]], size: int = 8) -> dict[str, Any]:
    """Every answered case in mixed groups of up to `size` (in file order, so long and short
    cases share groups) through the executor's runner, against the same case alone (`alone`:
    `run_cases`' answers by case name, from the same executor, one request per forward)."""
    from benchlib.executors import with_limits

    named = []
    for case in cases:
        if case["name"] not in alone:
            continue
        limited = with_limits(executor, dataclasses.replace(executor.limits,
                                                           max_length=case["max_length"]))
        named.append((case["name"], limited.encode(case["request"])))
    grouped: dict[str, list[list[float]]] = {}
    for first in range(0, len(named), size):
        group = named[first:first + size]
        rows = executor.runner.run([encoding for _, encoding in group]).rows
        for (name, encoding), row in zip(group, rows, strict=True):
            counts = [len(q.option_spans) for q in encoding.questions]
            grouped[name] = split_by_question(row.probabilities, counts)
    return {"layout": executor.runner.layout, "cases": len(named), "group_size": size,
            **compare_questions({name: alone[name] for name in grouped}, grouped),
            "grouped": grouped}


def write(summary: dict[str, Any], path: Path | None) -> None:
    """The result so far, atomically (a reader never sees half a file)."""
    if path is None:
        return
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    temporary.replace(path)


def without_answers(result: dict[str, Any]) -> dict[str, Any]:
    """A mode's result as written: its comparisons, not every probability."""
    groups = {k: v for k, v in result["packed_groups"].items() if k != "grouped"}
    return {**{k: v for k, v in result.items() if k != "per_question"}, "packed_groups": groups}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--fixtures", type=Path, default=FIXTURES)
    parser.add_argument("--cuda-graphs", choices=("auto", "on", "off", "both"), default="off",
                        help="on: length buckets (captured as CUDA graphs on CUDA, eager on CPU); "
                             "both: eager and on, compared")
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    parser.add_argument("--max-length", type=int, default=0,
                        help="the executor's limit at load (warm-up and buckets follow it; "
                             "each case then runs under its own; 0: the longest case's tokens, "
                             "rounded up to 64)")
    parser.add_argument("--max-batch-tokens", type=int, default=4096,
                        help="the token budget at load (graph shapes follow it)")
    parser.add_argument("--batch-layout", choices=("auto", "packed", "padded"), default="auto")
    parser.add_argument("--graph-max-length", type=int, default=0,
                        help="the longest bucket (0: --max-length's table, as the worker)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU, float32, torch path, eager and buckets compared; exit 1 "
                             "unless within the test tolerance")
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.dtype, args.gdn_prefill, args.cuda_graphs = (
            "cpu", "float32", "torch", "both")
        # A few buckets and a short warm-up: CPU builds each bucket eagerly. The longest case
        # has 1,513 tokens.
        args.max_length, args.graph_max_length = 2048, 512

    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot

    modes = ["off", "on"] if args.cuda_graphs == "both" else [args.cuda_graphs]
    if "on" in modes:
        # Before fla is first imported (by the eager load too): the capture's environment.
        from clef_worker.serving.gpu.capture import prepare_capture_environment

        prepare_capture_environment()
    cases = load_cases(args.fixtures / GOLDEN.name)
    if not args.max_length:
        longest = max(len(case["input_ids"]) for case in cases if "input_ids" in case)
        args.max_length = -(-longest // 64) * 64
    summary: dict[str, Any] = {"command": command_line(__file__), "cases": len(cases),
                               "modes": {}, "phase": "start"}
    problems: list[str] = []
    answers: dict[str, dict[str, Any]] = {}
    for mode in modes:
        executor = assemble_snapshot(args.fixtures / "clef-tiny", device=args.device,
                                       dtype=args.dtype, gdn_prefill=args.gdn_prefill,
                                       limits=RequestLimits(max_length=args.max_length),
                                       cuda_graphs=mode, media="off",
                                       graph_max_length=args.graph_max_length,
                                       max_batch_tokens=args.max_batch_tokens,
                                       batch_layout=args.batch_layout)
        executor.warm_up()  # with graphs: every bucket captured before the cases run
        info = dataclasses.asdict(executor.describe())
        found = capture_problems(info, graphs_requested=mode == "on",
                                 on_cuda=executor.device.type == "cuda")
        problems += [f"--cuda-graphs {mode}: {problem}" for problem in found]
        summary["device"], summary["dtype"] = str(executor.device), info["dtype"]
        summary["gdn_path"], summary["short_conv"] = info["gdn_path"], info["short_conv"]
        answered = run_cases(executor, cases)
        answers[mode] = {**answered, "capture": capture_report(info), "capture_problems": found,
                         "packed_groups": grouped_vs_alone(executor, cases,
                                                           answered["per_question"])}
        del executor  # its weights and graphs go before the next mode loads its own
        summary["modes"][mode] = without_answers(answers[mode])
        summary["argmax_mismatches_vs_golden"] = sum(
            len(m["argmax_mismatches"]) for m in summary["modes"].values())
        summary["packed_groups_argmax_equal"] = all(
            m["packed_groups"]["argmax_equal"] for m in summary["modes"].values())
        summary["phase"] = mode
        write(summary, args.out)
    if len(modes) == 2:
        summary["graphs_vs_eager"] = compare_questions(answers["off"]["per_question"],
                                                       answers["on"]["per_question"])
        summary["packed_graphs_vs_packed_eager"] = compare_questions(
            answers["off"]["packed_groups"]["grouped"], answers["on"]["packed_groups"]["grouped"])
    summary["within_test_tolerance"] = all(m["within_test_tolerance"]
                                           for m in summary["modes"].values())
    summary["phase"] = "done"
    print(json.dumps(summary))
    write(summary, args.out)
    for problem in problems:
        print(f"not graphs: {problem}", file=sys.stderr)
    if problems:
        return 1
    if args.quick and not (summary["within_test_tolerance"] and cases
                           and summary["graphs_vs_eager"]["argmax_equal"]
                           and summary["packed_graphs_vs_packed_eager"]["argmax_equal"]
                           and summary["packed_groups_argmax_equal"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time the native executor per request, split into encode / backbone / head / answer.

Not a test: it measures. For each snapshot (the shared tiny fixture and a wider random one made by
the demo generator) and each request size (1, 8, 64 questions) it loads the executor, warms it
up, runs a few untimed requests, then times repeated requests through `NativeExecutor.score(...,
profile=True)` (which syncs the device between stages) plus the response building and
serialisation (`answer`), and reports medians. It prints a docs/benchmarks.md section per
device kind, with the exact command and the machine; with `--write-docs` it also replaces that
section in the file (benchlib/docs_writer.py).

    python bench/bench_executor.py                    # CPU, prints the section
    python bench/bench_executor.py --write-docs       # ... and puts it in docs/benchmarks.md
    python bench/bench_executor.py --device cuda      # GPU section
    python bench/bench_executor.py --quick            # CI smoke run (see README)
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.docs_writer import DOC, add_write_docs_flag, raw_output_line, replace_section
from benchlib.paths import TINY_SNAPSHOT
from benchlib.provenance import command_line, cpu_line

STAGES = ("encode", "backbone", "head", "answer")

log = logging.getLogger("bench")

_STATE = (
    "Ticket 8812 from a long-standing customer: the order placed on 2026-03-02 (two chairs and a "
    "desk, invoice #55120, paid by card) arrived nine days late, one chair leg was cracked and "
    "the desk instructions were missing. The customer called twice, was promised a call back "
    "that never came, and now asks for a partial refund or a replacement chair by Friday. They "
    "mention they may cancel their business account if nothing happens this week."
)

_CHOICE_OPTIONS = {
    "billing": "Payments, invoices and refunds",
    "delivery": "Shipping, delays and damaged parcels",
    "product": "Defects or questions about a product",
    "account": "Login, profile and account settings",
    "other": None,
}

_SCORE_LEVELS = ["none", "low", "medium", "high", "critical"]


def make_request(questions: int) -> dict[str, Any]:
    """A deterministic request with `questions` questions cycling noul / choice / score."""
    items: dict[str, Any] = {}
    for k in range(questions):
        kind = ("noul", "choice", "score")[k % 3]
        if kind == "noul":
            question: dict[str, Any] = {
                "type": "noul", "instructions": f"Does the ticket mention problem number {k}?",
            }
        elif kind == "choice":
            question = {"type": "choice", "instructions": f"Which team should handle part {k}?",
                        "criteria": dict(_CHOICE_OPTIONS)}
        else:
            question = {"type": "score", "instructions": f"How severe is aspect {k}?",
                        "criteria": list(_SCORE_LEVELS)}
        items[f"q{k:02d}_{kind}"] = question
    return {"model": "bench", "state": {"ticket": _STATE, "channel": "email"},
            "questions": items}


@dataclass
class Row:
    """One (snapshot, request size) measurement."""

    questions: int
    options: int
    tokens: int
    repeats: int
    medians_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class SnapshotResult:
    label: str
    description: str
    load_s: float
    warmup_ms: float
    info: Any = None
    rows: list[Row] = field(default_factory=list)


def measure(executor: Any, questions: int, warmup: int, repeats: int,
            budget_s: float) -> Row:
    """Median stage times of one request size (fewer repeats if the time budget runs out)."""
    from clef_worker.model.answers import serialize

    request = make_request(questions)
    for _ in range(warmup):
        serialize(executor.score(request).response())
    samples: dict[str, list[float]] = {stage: [] for stage in (*STAGES, "total")}
    encoding = None
    started_all = time.perf_counter()
    for _ in range(repeats):
        started = time.perf_counter()
        scored = executor.score(request, profile=True)
        answered = time.perf_counter()
        serialize(scored.response())
        finished = time.perf_counter()
        for stage in ("encode", "backbone", "head"):
            samples[stage].append(scored.timings_ms[stage])
        samples["answer"].append((finished - answered) * 1000)
        samples["total"].append((finished - started) * 1000)
        encoding = scored.encoding
        if time.perf_counter() - started_all > budget_s and len(samples["total"]) >= 3:
            break
    assert encoding is not None
    return Row(
        questions=questions,
        options=sum(len(q.option_spans) for q in encoding.questions),
        tokens=encoding.length,
        repeats=len(samples["total"]),
        medians_ms={stage: statistics.median(values) for stage, values in samples.items()},
    )


def describe_snapshot(path: Path) -> str:
    import json

    config = json.loads((path / "config.json").read_text())["text_config"]
    head = json.loads((path / "joint_head_config.json").read_text())
    return (f"H {config['hidden_size']}, {config['num_hidden_layers']} layers, vocab rows "
            f"{config['vocab_size']}; head W {head['width']}, F {head['feedforward']}, "
            f"{head['routing_layers']}+{head['layers']} layers, {head['heads']} heads")


def run_snapshot(label: str, path: Path, args: argparse.Namespace) -> SnapshotResult:
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot

    log.info("%s: loading %s", label, path)
    started = time.perf_counter()
    executor = assemble_snapshot(path, variant=args.variant, device=args.device,
                                   dtype=args.dtype, gdn_prefill=args.gdn_prefill,
                                   limits=RequestLimits(max_length=args.max_length))
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    executor.warm_up()
    warmup_ms = (time.perf_counter() - started) * 1000
    result = SnapshotResult(label=label, description=describe_snapshot(path), load_s=load_s,
                            warmup_ms=warmup_ms, info=executor.describe())
    for questions in args.questions:
        row = measure(executor, questions, args.warmup, args.repeats, args.budget)
        log.info("%s, %d questions: %s", label, questions,
                 {k: round(v, 2) for k, v in row.medians_ms.items()})
        result.rows.append(row)
    return result


def machine_line(device: str) -> str:
    import torch
    import transformers

    parts = [cpu_line()]
    if device.startswith("cuda"):
        parts.append(f"GPU {torch.cuda.get_device_name(torch.device(device))}, "
                     f"CUDA {torch.version.cuda}")
    parts.append(f"torch {torch.__version__}, transformers {transformers.__version__}, "
                 f"Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    return "; ".join(parts)


def render_section(kind: str, results: list[SnapshotResult], args: argparse.Namespace,
                   load: tuple[float, float]) -> str:
    info = results[0].info
    lines = [
        f"<!-- bench-executor:{kind} -->",
        f"## {kind.upper()} (`--device {args.device}`)",
        "",
        f"Command (from the repository root): `{command_line(__file__)}`",
        "",
        raw_output_line(None),
        "",
        f"Machine: {machine_line(args.device)}. 1-minute load average {load[0]:.2f} at the "
        f"start, {load[1]:.2f} at the end (other work on the machine inflates the numbers).",
        "",
        f"Run {datetime.date.today().isoformat()}: device {info.device}, dtype {info.dtype}, "
        f"Gated DeltaNet path {info.gdn_path}; {args.warmup} untimed request(s), then up to "
        f"{args.repeats} timed ones per row (fewer past {args.budget:g} s); medians in ms. "
        "`answer` is building and serialising the response; `total` is the whole request "
        "(the stages plus glue: tensor copies, index building). The first snapshot's load time "
        "includes importing the model code.",
        "",
    ]
    for result in results:
        lines += [
            f"### {result.label}",
            "",
            f"{result.description}. Load {result.load_s:.2f} s, warm-up "
            f"{result.warmup_ms:.0f} ms.",
            "",
            "| questions | options | tokens | encode | backbone | head | answer | total | n |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result.rows:
            cells = [f"{row.medians_ms[s]:.2f}" for s in (*STAGES, "total")]
            lines.append(f"| {row.questions} | {row.options} | {row.tokens} | "
                         + " | ".join(cells) + f" | {row.repeats} |")
        lines.append("")
    lines.append(f"<!-- /bench-executor:{kind} -->")
    return "\n".join(lines) + "\n"


_HEADER = """# Benchmarks

Per-request latency of the native executor, split into its stages: `encode` (validation and
tokenisation), `backbone` (the Qwen3.5 text stack, last hidden state), `head` (the joint schema
head), `answer` (response object and JSON bytes). Produced by `bench/bench_executor.py`; each
section below is replaced when the script runs again with `--write-docs` on the same kind of
device, and records the
command that produced it. The snapshots are random (the shared tiny fixture and a wider one from
the demo generator), so these numbers measure the serving code, not a real Clef model: real
Clef-Flash has H 4096 and 32 layers (docs/model.md has figures measured on real weights).
Their tokenizers are also small BPEs trained on little text, so client text takes more tokens
than with the real 248k-entry vocabulary; the `tokens` column is what each stage processed.

"""


def write_doc(section: str, kind: str) -> None:
    replace_section(section, f"<!-- bench-executor:{kind} -->",
                    f"<!-- /bench-executor:{kind} -->", header=_HEADER)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--gdn-prefill", default="auto", choices=("auto", "fla", "torch"))
    parser.add_argument("--snapshots", default="tiny,wide",
                        help="comma list of tiny (shared fixture), wide (generated), or paths")
    parser.add_argument("--questions", default="1,8,64",
                        type=lambda text: [int(x) for x in text.split(",")])
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests per row")
    parser.add_argument("--repeats", type=int, default=20, help="timed requests per row, at most")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="seconds of timed requests per row before stopping early")
    parser.add_argument("--variant", default="clef-flash", choices=("clef-flash", "clef"),
                        help="for real snapshots given as paths (random ones skip the check)")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default)")
    add_write_docs_flag(parser)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny fixture on CPU, 1 and 3 questions, 2 repeats, no "
                             "writes")
    args = parser.parse_args(argv)
    if args.quick:
        args.device, args.snapshots, args.questions = "cpu", "tiny", [1, 3]
        args.warmup, args.repeats, args.budget, args.write_docs = 1, 2, 5.0, False
    return args


def resolve_snapshots(spec: str) -> list[tuple[str, Path]]:
    snapshots = []
    for item in spec.split(","):
        if item == "tiny":
            snapshots.append(("clef-tiny fixture (tests/fixtures/clef-tiny)", TINY_SNAPSHOT))
        elif item == "wide":
            from clef_worker.demo import DemoSpec, ensure_demo_snapshot

            path = ensure_demo_snapshot(spec=DemoSpec.wide())
            snapshots.append(("wide random snapshot (demo generator, DemoSpec.wide())", path))
        else:
            snapshots.append((item, Path(item)))
    return snapshots


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    snapshots = resolve_snapshots(args.snapshots)
    results = [run_snapshot(label, path, args) for label, path in snapshots]
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    section = render_section(kind, results, args, (load_before, os.getloadavg()[0]))
    print(section)
    if args.write_docs:
        write_doc(section, kind)
        log.info("wrote %s", DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

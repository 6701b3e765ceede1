"""Render the plots of docs/benchmarks.md from the committed results in bench/results/.

Not a benchmark (nothing is measured here): the pictures are drawn from the raw files the
device and CPU runs left, so a plot can always be traced to a file and that file to its command
(bench/results/README.md). Rerun it whenever a result file changes:

    python bench/plot_results.py               # writes docs/img/*.png
    python bench/plot_results.py --out /tmp/x  # somewhere else (docs untouched)
    python bench/plot_results.py --quick       # every plot drawn into a temporary folder (CI)

Plots:
- `latency-by-length.png`: Flash-shaped model on the H200, answer p50 by input tokens (bars:
  min to max), fla and torch Gated DeltaNet paths, 32 layers, and the 8-layer fla run;
- `throughput-by-concurrency.png`: on CPU, requests/s of clef-serve by concurrent clients with
  clef-batch's rate beside it (`cpu-batch-vs-server.json`); on the H200, the end-to-end
  latency of the demo snapshot over HTTP with 1 and 8 clients (the session's `http_demo_cuda`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DOCS_IMG = REPO / "docs" / "img"

LENGTH_RUNS = (
    ("h200-flash-shaped-fla.json", "fla, 32 layers"),
    ("h200-flash-shaped-torch.json", "torch, 32 layers"),
    ("h200-flash8-fla-fresh-lengths.json", "fla, 8 layers"),
)
SESSION = "h200-session-2026-11-29.jsonl"
CPU_BATCH = "cpu-batch-vs-server.json"


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def _session_step(step: str) -> Any:
    for line in (RESULTS / SESSION).read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record["step"] == step:
            return json.loads(record["stdout"])
    raise KeyError(f"step {step!r} not in {SESSION}")


def latency_by_length(path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for name, label in LENGTH_RUNS:
        cases = sorted(_load(name)["cases"].values(), key=lambda case: case["input_tokens"])
        tokens = [case["input_tokens"] for case in cases]
        p50 = [case["answer_p50_ms"] for case in cases]
        low = [p - case["answer_min_ms"] for p, case in zip(p50, cases, strict=True)]
        high = [case["answer_max_ms"] - p for p, case in zip(p50, cases, strict=True)]
        axes.errorbar(tokens, p50, yerr=[low, high], marker="o", capsize=3, label=label)
    axes.set(xscale="log", xlabel="input tokens", ylabel="answer p50 (ms; bars: min to max)",
             title="H200, Flash-shaped random weights, bf16, eager (2026-11-29)")
    ticks = [250, 500, 1000, 2000, 4000, 8000]
    axes.minorticks_off()
    axes.set_xticks(ticks, [str(tick) for tick in ticks])
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def throughput_by_concurrency(path: Path) -> None:
    cpu = _load(CPU_BATCH)
    http = _session_step("http_demo_cuda")
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    levels = sorted(int(c) for c in cpu["server"])
    rates = [cpu["server"][str(c)]["throughput_rps"] for c in levels]
    left.plot(levels, rates, marker="o", label="clef-serve (clef-bench clients)")
    left.axhline(cpu["batch"]["throughput_rps"], color="tab:red", linestyle="--",
                 label="clef-batch (same worker flags)")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="requests / s",
             title=f"CPU ({cpu['machine'].split(' (')[0]}), demo snapshot\n{cpu['tokens']}-word, "
                   f"{cpu['questions']}-question requests")
    left.set_xticks(levels, [str(c) for c in levels])
    left.set_ylim(bottom=0)
    left.legend(loc="lower right")
    clients = [1, http["concurrent"]["clients"]]
    for key, style in (("p50_ms", "o-"), ("p95_ms", "s--"), ("p99_ms", "^:")):
        right.plot(clients, [http["sequential"][key], http["concurrent"][key]], style,
                   label=key.removesuffix("_ms"))
    right.set(xscale="log", xlabel="concurrent clients", ylabel="latency (ms)",
              title=f"H200, demo snapshot over HTTP (2026-11-29)\n"
                    f"{http['concurrent']['throughput_rps']} req/s at C{clients[1]}")
    right.set_xticks(clients, [str(c) for c in clients])
    right.set_ylim(bottom=0)
    right.legend()
    for axes in (left, right):
        axes.minorticks_off()
        axes.grid(True, alpha=0.3)
    figure.savefig(path, dpi=100)
    plt.close(figure)


PLOTS = {"latency-by-length.png": latency_by_length,
         "throughput-by-concurrency.png": throughput_by_concurrency}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DOCS_IMG, help="folder for the PNGs")
    parser.add_argument("--quick", action="store_true",
                        help="draw every plot into a temporary folder, docs untouched (the "
                             "bench/ convention: a quick run writes nothing it keeps)")
    args = parser.parse_args(argv)
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="clef-plots-") as folder:
            return _draw_all(Path(folder))
    return _draw_all(args.out)


def _draw_all(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        draw(out / name)
        print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

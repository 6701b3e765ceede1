"""`clef-bench`'s results: one row per concurrency, `report.json`, and `latency.png`.

Percentiles are numpy's (linear interpolation), over the requests answered 200; the others are
counted in `errors`, so a server that answers fast 503s cannot look fast. Throughput is every
request sent divided by the run's wall time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RunRow:
    """One concurrency level's result (a row of `runs` in report.json)."""

    concurrency: int
    requests: int
    throughput_rps: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    errors: int


def summarise(concurrency: int, latencies_ms: Sequence[float], errors: int,
              wall_seconds: float) -> RunRow:
    """The row for one run: `latencies_ms` of the successful requests, `errors` the others."""
    sent = len(latencies_ms) + errors
    marks: list[float | None] = [None] * len(PERCENTILES)
    if latencies_ms:
        marks = [round(float(v), 3)
                 for v in np.percentile(np.asarray(latencies_ms), PERCENTILES)]
    p50, p90, p99 = marks
    return RunRow(concurrency, sent, round(sent / max(wall_seconds, 1e-9), 3), p50, p90, p99,
                  errors)


def write_report(path: Path, server: Any, rows: Sequence[RunRow], **extra: Any) -> None:
    """`{"server": <GET /health>, "runs": [...], **extra}` as indented JSON."""
    document = {"server": server, "runs": [asdict(row) for row in rows], **extra}
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def plot_runs(path: Path, rows: Sequence[RunRow], title: str) -> None:
    """Latency percentiles (left) and throughput (right) by concurrency, as a PNG.

    matplotlib comes with the `plot` extra; the Agg backend draws without a display.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [row.concurrency for row in rows]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for name in ("p50_ms", "p90_ms", "p99_ms"):
        values = [getattr(row, name) for row in rows]
        latency.plot(levels, [np.nan if v is None else v for v in values], marker="o",
                     label=name.removesuffix("_ms"))
    latency.set(xlabel="concurrent clients", ylabel="latency (ms)", title="latency")
    latency.legend()
    throughput.plot(levels, [row.throughput_rps for row in rows], marker="o", color="tab:green")
    throughput.set(xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    for axes in (latency, throughput):
        axes.set_xscale("log", base=2)
        axes.minorticks_off()
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.grid(True, alpha=0.3)
        axes.set_ylim(bottom=0)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    plt.close(figure)

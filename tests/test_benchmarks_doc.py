"""docs/benchmarks.md's raw files: every file it cites under bench/results/ exists, every kept raw
file is cited, and a generated table that misses its own bound says so. Each figure's own label,
in every doc, is tests/test_docs_figures.py's."""

from __future__ import annotations

import re

from benchlib.docs_writer import DOC, NO_RAW_OUTPUT, raw_output_line
from tests.conftest import REPO
from tests.docs_figures import FIGURE

RESULTS = REPO / "bench" / "results"
CITED = re.compile(r"bench/results/([\w.-]+(?:/[\w.-]+)*)")


def test_every_cited_raw_file_exists() -> None:
    cited = set(CITED.findall(DOC.read_text(encoding="utf-8"))) - {"FILE"}  # the label's syntax
    assert cited, "docs/benchmarks.md cites no raw output at all"
    assert sorted(name for name in cited if not (RESULTS / name).is_file()) == []


def test_every_kept_raw_file_is_cited_by_the_doc_or_the_results_readme() -> None:
    text = DOC.read_text(encoding="utf-8") + (RESULTS / "README.md").read_text(encoding="utf-8")
    kept = {str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*")
            if path.is_file() and path.name != "README.md"}
    assert sorted(name for name in kept if name not in text) == []


def test_the_check_finds_figures_and_a_missing_source() -> None:
    assert FIGURE.search("p50 20.2 ms") and FIGURE.search("1.58 ×")
    assert not FIGURE.search("H 4096, 32 layers")
    assert raw_output_line("bench/results/x.json") == "Raw output: `bench/results/x.json`."
    assert raw_output_line(None).startswith(NO_RAW_OUTPUT)


def test_a_generated_metrics_table_flags_a_row_over_its_bound() -> None:
    """bench_metrics_under_load's section names the rows whose p99 under load misses the bound
    (the doc's table once stated the bound under a row that missed it and flagged nothing)."""
    from bench.bench_metrics_under_load import markdown

    def row(p99: float) -> dict[str, object]:
        stats = {"n": 10, "p50_ms": 1.0, "p99_ms": p99, "max_ms": p99}
        return {"idle": stats, "loaded": stats, "body_bytes": 100, "load_rps": [1.0]}

    report = {"command": "python bench/bench_metrics_under_load.py", "host": "h", "clients": 32,
              "seconds_per_round": 10, "rounds": 3, "interval_ms": 50, "load_average": [1, 1],
              "p99_bound_ms": 10.0, "raw_output": "bench/results/m.json",
              "rows": {"public /metrics": row(11.31), "metrics-port /metrics": row(6.2)}}
    text = markdown(report)
    assert "**Missed by public /metrics (11.31 ms)**" in text
    assert "metrics-port /metrics (" not in text
    assert "Raw output: `bench/results/m.json`." in text
    report["rows"] = {"metrics-port /metrics": row(6.2)}
    assert "Met by every row." in markdown(report)


def test_the_doc_flags_the_scrape_that_missed_its_bound() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("<!-- bench-metrics:under-load -->"):]
    over = [line for line in section.splitlines()
            if line.startswith("| ") and "| loaded |" in line
            and float(line.split(" | ")[4]) > 10.0]
    for line in over:
        name = line.strip("| ").split(" | ")[0]
        assert f"Missed by {name}" in section or f"{name} (" in section

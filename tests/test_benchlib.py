"""The helper layer shared by bench/, stress/ and tests/ (benchlib/): percentiles, the docs
writer, stress discovery, and that stress/ and bench/ reach it without path tricks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from benchlib.docs_writer import replace_section
from benchlib.paths import REPO
from benchlib.timing import latency_summary, percentile
from stress.run_all import scenarios
from tests.ci_policy import require

BEGIN, END = "<!-- x -->", "<!-- /x -->"


def test_percentiles_follow_numpy() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile([], 0.5) == 0.0
    assert latency_summary([3.0, 1.0, 2.0]) == {"p50_ms": 2.0, "p99_ms": 2.98, "min_ms": 1.0,
                                                "max_ms": 3.0, "n": 3}


def test_the_docs_writer_replaces_only_its_own_section(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    replace_section(f"{BEGIN}\nnew\n{END}\n", BEGIN, END, doc)
    assert doc.read_text() == f"# B\n\nbefore\n\n{BEGIN}\nnew\n{END}\n\nafter\n"
    replace_section("<!-- y -->\nother\n<!-- /y -->\n", "<!-- y -->", "<!-- /y -->", doc)
    assert doc.read_text().endswith("after\n\n<!-- y -->\nother\n<!-- /y -->\n")
    with pytest.raises(ValueError):
        replace_section("no markers\n", BEGIN, END, doc)


def _unguarded_docs_writes(path: Path) -> list[str]:
    """Calls of the docs writer in `path` that do not sit inside an `if` on `write_docs`
    (the body of the `write_doc` wrapper itself aside)."""
    tree = ast.parse(path.read_text())
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and "write_docs" in ast.unparse(node.test)) or (
                isinstance(node, ast.FunctionDef) and node.name == "write_doc"):
            guarded |= {id(child) for child in ast.walk(node)}
    return [ast.unparse(node) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and id(node) not in guarded
            and ast.unparse(node.func) in ("replace_section", "write_doc")]


def test_no_benchmark_rewrites_the_docs_unless_asked() -> None:
    sources = [*REPO.glob("bench/*.py"), *REPO.glob("benchlib/*.py")]
    writers = [p for p in sources if p.name != "docs_writer.py"
               and "replace_section(" in p.read_text()]
    assert {p.name for p in writers} >= {"bench_executor.py", "zero_work.py"}
    for path in sources:
        if path.name != "docs_writer.py":
            assert _unguarded_docs_writes(path) == [], path.name


def test_stress_scenarios_are_discovered_by_name() -> None:
    found = scenarios()
    assert {"drain", "exactly_once", "fuzz", "hung_worker", "idle_burst", "slow_clients",
            "worker_kill"} <= set(found)
    assert not {"common", "run_all", "__init__"} & set(found)
    assert all(not name.startswith("_") for name in found)
    for name in found:  # each follows the convention: a main(argv) to run
        tree = ast.parse((REPO / "stress" / f"{name}.py").read_text())
        names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert "main" in names | functions, name


def test_stress_and_bench_import_no_tests_and_insert_no_other_paths() -> None:
    """stress/ and benchlib/ run from the repository root and touch no path; a bench script
    puts the root first with the one documented line (bench/README.md), nothing else."""
    from tests.test_bench_convention import BOOTSTRAP

    for path in [*REPO.glob("stress/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("benchlib/*.py")]:
        text = path.read_text()
        if path.parent.name == "bench":
            text = text.replace(BOOTSTRAP, "", 1)
        assert "sys.path.insert" not in text and "sys.path.append" not in text, path
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("tests"), (path, node.module)


def test_a_bench_script_imports_benchlib_from_any_directory(tmp_path: Path) -> None:
    """`python bench/<script>.py` (the script's folder first on sys.path, not the root; benchlib
    is not installed) reaches benchlib through its first line, whatever the working directory
    and with PYTHONPATH ignored (-I)."""
    done = subprocess.run([sys.executable, "-I", str(REPO / "bench" / "bench_gated_delta.py"),
                           "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "--quick" in done.stdout


def test_numbered_bodies_are_distinct_json_with_the_same_members() -> None:
    import json

    from benchlib.http_load import numbered

    body = b'{"model": "m", "state": "s"}'
    first, second = numbered(body, "1-1"), numbered(body, "1-2")
    assert first != second
    assert json.loads(first) == {"seq": "1-1", "model": "m", "state": "s"}
    with pytest.raises(ValueError, match="non-empty JSON object"):
        numbered(b"{ }", "1")


@pytest.mark.parametrize("use_wrk", [False, True])
def test_distinct_load_reaches_the_worker_through_the_default_cache(use_wrk: bool) -> None:
    """The zero-work benchmark's POSTs are misses of the answer cache (on by default), so the
    benchmark measures the path through admission and the worker, not the cache."""

    from benchlib.http_load import run_load
    from benchlib.serve import Serve
    from benchlib.zero_work import BODY
    from tests.traffic_helpers import metric

    if use_wrk:
        require("wrk")  # the benchmarks' load generator where installed (skip locally, CI fails)
    with Serve(max_batch=None) as serve:
        result = run_load("127.0.0.1", serve.port, "POST", "/v1/systemone", BODY,
                          connections=4, seconds=1.0, use_wrk=use_wrk, distinct=True)
        assert result.requests > 0 and result.bad_status == 0
        misses = metric(serve, "clef_answer_cache_total", result="miss")
        assert metric(serve, "clef_answer_cache_total", result="hit") == 0
        assert metric(serve, "clef_answer_cache_total", result="coalesced") == 0
        assert misses >= result.requests  # wrk does not count requests cut off at its end

"""`clef-bench` against a real server: the report's rows are what it sent, and a PNG is drawn.

The main case runs the server with the real worker on the shared tiny fixture; the route and key
cases use the fake worker (no model), where only the HTTP side matters.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from clef_tools.bench_body import generated_body
from clef_tools.bench_report import summarise
from clef_tools.http_client import Endpoint
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import REPO, Serve

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
POSTED = re.compile(r"request method=POST path=(\S+) status=(\d+)")


def bench(port: int, out: Path, *args: str, env: dict[str, str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clef_tools.bench", f"http://127.0.0.1:{port}", "--out", str(out),
         *args], cwd=REPO, capture_output=True, text=True, timeout=600, check=False, env=env)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", data[:16]
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def posted(server: Serve, count: int) -> list[tuple[str, str]]:
    """(path, status) of the POSTs in the access log, once `count` of them are there (a line
    is written just after its answer, so the last may trail the client's exit)."""
    deadline = time.monotonic() + 30
    while True:
        found = [(m[1], m[2]) for line in server.stderr.splitlines()
                 if (m := POSTED.search(line))]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.01)  # polling interval, not a synchronisation guess


def test_report_rows_match_what_was_sent(tmp_path: Path) -> None:
    with Serve(real_worker=True, startup_wait=240, max_batch=None,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu")) as server:
        health = server.health().json()
        result = bench(server.port, tmp_path, "--requests", "12", "--concurrency", "1", "3",
                       "--tokens", "60", "--questions", "2", "--warmup", "2",
                       "--progress-interval", "0")
        assert result.returncode == 0, result.stderr
        # Every request reached the server's access log: warm-up, then 12 per level.
        sent = posted(server, 2 + 12 * 2)
    assert sent == [("/v1/systemone", "200")] * (2 + 12 * 2)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["server"]["worker"]["pid"] == health["worker"]["pid"]
    assert report["server"]["status"] == "ready"
    assert [row["concurrency"] for row in report["runs"]] == [1, 3]
    for row in report["runs"]:
        assert set(row) == {"concurrency", "requests", "throughput_rps", "p50_ms", "p90_ms",
                            "p99_ms", "errors"}
        assert row["requests"] == 12 and row["errors"] == 0
        assert 0 < row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
        assert row["throughput_rps"] > 0
    assert report["body_bytes"] == len(generated_body(60, 2))
    width, height = png_size(tmp_path / "latency.png")
    assert (width, height) == (1000, 400)
    assert (tmp_path / "latency.png").stat().st_size > 10_000
    # Plain progress lines on a non-terminal stderr, ending at N/N for each level.
    assert "clef-bench C1: 12/12" in result.stderr and "clef-bench C3: 12/12" in result.stderr


def test_workers_ai_route_with_a_key(tmp_path: Path) -> None:
    key = "bench-key-0123456789"
    with Serve(env={"CLEF_API_KEY": key}) as server:
        env = dict(os.environ, CLEF_API_KEY=key)
        ok = bench(server.port, tmp_path / "ok", "--requests", "5", "--concurrency", "2",
                   "--workers-ai", "--account-id", "acct", "--warmup", "0", env=env)
        assert ok.returncode == 0, ok.stderr
        refused = bench(server.port, tmp_path / "refused", "--requests", "4", "--concurrency",
                        "1", "--warmup", "0", "--api-key", "wrong-key-0123456789", env=env)
        sent = posted(server, 5 + 4)
    run = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert run["target"] == "/accounts/acct/ai/run/@cf/cloudflare/clef-flash"
    assert run["runs"][0]["requests"] == 5 and run["runs"][0]["errors"] == 0
    assert refused.returncode == 1
    bad = json.loads((tmp_path / "refused" / "report.json").read_text())["runs"][0]
    assert bad["errors"] == 4 and bad["p50_ms"] is None
    assert "4 x 401" in refused.stderr
    assert sent == ([("/accounts/acct/ai/run/@cf/cloudflare/clef-flash", "200")] * 5
                    + [("/v1/systemone", "401")] * 4)


def test_summary_percentiles_and_errors() -> None:
    row = summarise(4, [float(v) for v in range(1, 101)], errors=5, wall_seconds=2.0)
    assert (row.requests, row.errors, row.throughput_rps) == (105, 5, 52.5)
    assert (row.p50_ms, row.p90_ms, row.p99_ms) == (50.5, 90.1, 99.01)


@pytest.mark.parametrize("url", ["https://host:1", "http://host:1/v1/systemone", "host:1"])
def test_endpoint_refuses_what_it_cannot_load(url: str) -> None:
    with pytest.raises(ValueError):
        Endpoint.parse(url)


def test_generated_body_is_a_valid_request() -> None:
    from clef_protocol.body import parse_body
    from clef_protocol.options import RequestLimits
    from clef_protocol.validation import validate_request

    request: dict[str, Any] = parse_body(generated_body(50, 5))
    validate_request(request, RequestLimits())
    assert len(request["state"].split()) == 50
    assert [q["type"] for q in request["questions"].values()] == [
        "noul", "choice", "score", "noul", "choice"]


def test_docs_plots_render_from_the_committed_results(tmp_path: Path) -> None:
    """bench/plot_results.py draws every plot of docs/benchmarks.md from bench/results/ alone,
    and the committed pictures are the ones it draws (same size)."""
    result = subprocess.run([sys.executable, "bench/plot_results.py", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    from bench.plot_results import DOCS_IMG, PLOTS

    for name in PLOTS:
        drawn = tmp_path / name
        assert png_size(drawn) == png_size(DOCS_IMG / name)
        assert drawn.stat().st_size > 10_000
        assert f"img/{name}" in (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")


def _cache_results(port: int) -> dict[str, float]:
    """`clef_answer_cache_total` by result, from the server's /metrics."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {sample.labels["result"]: sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "clef_answer_cache"
            for sample in family.samples if sample.name == "clef_answer_cache_total"}


def test_every_request_is_a_forward_even_with_the_answer_cache_on(tmp_path: Path) -> None:
    """clef-bench numbers each body, so a server's answer cache (on by default) answers none of
    them from memory; `--same-body` sends the body as it is, and the cache answers repeats."""
    with Serve() as server:
        varied = bench(server.port, tmp_path / "varied", "--requests", "6", "--concurrency", "1",
                       "--warmup", "2")
        assert varied.returncode == 0, varied.stderr
        assert _cache_results(server.port) == {"hit": 0, "coalesced": 0, "miss": 8}
        same = bench(server.port, tmp_path / "same", "--requests", "6", "--concurrency", "1",
                     "--warmup", "2", "--same-body")
        assert same.returncode == 0, same.stderr
        assert _cache_results(server.port) == {"hit": 7, "coalesced": 0, "miss": 9}

"""deploy/grafana/clef-serve.json: every metric the dashboard (and the alert rules) name is one
that a real `clef-serve` exports on `/metrics`, its queries parse as PromQL, and its scoring-route
matcher is the alert rules' and covers both scoring routes.

The scrape comes from a real front with the fake worker after one scoring request on each
scoring route, parsed with prometheus_client's own text parser."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from clef_api.routes import Route
from clef_frontend.metrics import route_label
from tests.conftest import REPO
from tests.deploy_tools import RULES, SCORING, require, scoring_matcher
from tests.frontend_helpers import Serve, clef_body

DASHBOARD = REPO / "deploy" / "grafana" / "clef-serve.json"
# Grafana's variables, replaced by values a query would run with.
VARIABLES = {"$job": ".*", "$instance": ".*", "$__rate_interval": "1m"}
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*\w+\)$")
METRIC_NAME = re.compile(r"\bclef_[a-z0-9_]+\b")
# Suffixes of the samples a family exports, by type (the parser strips `_total` from counters).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
            "gauge": ("",), "summary": ("_sum", "_count", "")}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold theirs


def variable(board: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(v for v in board["templating"]["list"] if v["name"] == name)
    return found


def queries(board: dict[str, Any]) -> list[str]:
    """Every PromQL expression: panel targets and query variables, variables substituted."""
    found = [target["expr"] for panel in panels(board) for target in panel.get("targets", [])]
    # A query variable's `label_values(SELECTOR, LABEL)` is Grafana's: the selector is PromQL.
    found += [LABEL_VALUES.sub(r"\1", v["query"]["query"])
              for v in board["templating"]["list"] if v["type"] == "query"]
    values = {**VARIABLES, "$scoring_routes": variable(board, "scoring_routes")["query"]}
    substituted = []
    for expr in found:
        for name, value in sorted(values.items(), key=lambda item: -len(item[0])):
            expr = expr.replace(name, value)
        substituted.append(expr)
    return substituted


def named_metrics(texts: list[str]) -> set[str]:
    return {name for text in texts for name in METRIC_NAME.findall(text)}


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


@cache
def scrape() -> dict[str, str]:
    """Family name -> type, from a real front's /metrics after one request per scoring route
    (its fake worker reports a prefix cache and a self-check verdict, as the real one does by
    default)."""
    run_path = "/accounts/acct-1/ai/run/@cf/cloudflare/clef-flash"
    with Serve("--fake-prefix-cache", "--fake-self-check") as server:
        assert server.post(clef_body()).status == 200
        assert server.request("POST", run_path, clef_body()).status == 200
        response = server.request("GET", "/metrics")
        assert response.status == 200
        text = response.body.decode()
    families = list(text_string_to_metric_families(text))
    # Both scoring routes really were counted, under the labels the matchers expect.
    routes = {sample.labels.get("route") for family in families for sample in family.samples
              if family.name == "clef_http_requests"}
    assert {route_label(route.path, known=True) for route in SCORING} <= routes
    return {family.name: family.type for family in families}


def exported(name: str, families: dict[str, str]) -> bool:
    return any(name == family + suffix for family, kind in families.items()
               for suffix in SUFFIXES.get(kind, ("",)))


def test_the_dashboard_covers_what_operators_watch() -> None:
    """Queue depth, queue vs worker latency, batch size, tokens, restarts by reason,
    truncations, cache results, refusals by key: each has a panel."""
    names = named_metrics(queries(dashboard()))
    for metric in ("clef_queue_depth", "clef_request_queue_seconds_bucket",
                   "clef_request_worker_seconds_bucket", "clef_request_batch_size_bucket",
                   "clef_request_input_tokens_bucket", "clef_worker_restarts_total",
                   "clef_states_truncated_total", "clef_truncated_tokens_total",
                   "clef_answer_cache_total", "clef_quota_refusals_total",
                   "clef_prefix_cache_tokens_reused_total", "clef_prefix_cache_bytes"):
        assert metric in names, f"no panel shows {metric}"
    texts = json.dumps(dashboard())
    for label in ("by (reason)", "by (result)", "by (key)"):
        assert label in texts


def test_every_metric_named_is_exported() -> None:
    """Every metric the dashboard or the alert rules name is on a real front's /metrics."""
    families = scrape()
    named = named_metrics(queries(dashboard()) + rule_expressions())
    missing = sorted(name for name in named if not exported(name, families))
    assert not missing, f"named by the dashboard or rules, not exported: {missing}"


def test_the_name_check_would_catch_a_typo() -> None:
    families = scrape()
    assert exported("clef_request_queue_seconds_bucket", families)
    assert exported("clef_http_requests_total", families)
    assert not exported("clef_request_queue_second_bucket", families)
    assert not exported("clef_http_requests", families)


def test_the_scoring_routes_are_the_alert_rules() -> None:
    matcher = variable(dashboard(), "scoring_routes")["query"]
    assert matcher == scoring_matcher(yaml.safe_load(RULES.read_text()))
    regex = re.compile(matcher)
    for route in Route:
        assert bool(regex.fullmatch(route_label(route.path, known=True))) == (route in SCORING)


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule: `check rules` parses its expression)."""
    promtool = require("promtool")
    board = dashboard()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{n}", "expr": expr}
        for n, expr in enumerate(queries(board))]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(x[1m])"}]}]}
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode != 0


def test_panels_are_laid_out_and_unique() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "clef-serve"
    for panel in panels(board):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
            assert panel["description"], f"{panel['title']}: say what the panel shows"

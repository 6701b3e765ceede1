"""deploy/prometheus/: the alert rules pass `promtool check rules`, their unit tests pass
`promtool test rules` (synthetic series, no server), the Kubernetes PrometheusRule carries the
same groups, and the scoring-route matcher covers exactly the server's scoring routes.

`python -m tests.test_deploy_alerts --write` copies the rules file's groups into the
PrometheusRule after an edit (the rules file owns them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from clef_api.routes import Route
from clef_frontend.metrics import route_label
from tests.conftest import REPO
from tests.deploy_tools import RULES, SCORING, require, scoring_matcher

RULE_TESTS = RULES.with_name("clef-serve-rules.test.yaml")
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "components" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# deploy/prometheus/clef-serve-rules.yaml as a PrometheusRule: the groups are a copy of that file,
# which owns them (tests/test_deploy_alerts.py fails when the two differ). After editing the
# rules file, run `python -m tests.test_deploy_alerts --write`.
"""


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require("promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


def test_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_unit_tests_pass() -> None:
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests really test: a rules file that forgets the Workers-AI route fails them."""
    text = RULES.read_text()
    matcher = scoring_matcher(yaml.safe_load(text))
    broken = text.replace(matcher, "/v1/systemone")
    assert broken != text
    (tmp_path / RULES.name).write_text(broken)
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "ClefQueueFullRefusals" in result.stdout + result.stderr


def groups() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return found


def test_prometheus_rule_carries_the_rules_file() -> None:
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == groups(), (
        "the PrometheusRule differs from deploy/prometheus/clef-serve-rules.yaml: run "
        "`python -m tests.test_deploy_alerts --write`")


def test_the_route_matcher_is_the_scoring_routes() -> None:
    """Every route label the server can emit: the scoring ones match (PromQL anchors the regex
    at both ends, as fullmatch does), the others do not."""
    regex = re.compile(scoring_matcher(yaml.safe_load(RULES.read_text())))
    for route in Route:
        value = route_label(route.path, known=True)
        assert bool(regex.fullmatch(value)) == (route in SCORING), value
    assert not regex.fullmatch(route_label(b"/anything", known=False))


def test_the_unit_tests_use_the_real_route_labels() -> None:
    """The synthetic series carry the labels the server really emits for both scoring routes."""
    text = RULE_TESTS.read_text()
    for route in SCORING:
        assert f'route="{route_label(route.path, known=True)}"' in text


def write() -> None:
    """Copy the rules file's groups into the PrometheusRule."""
    document = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                "metadata": {"name": "clef-serve",
                             "labels": {"app.kubernetes.io/name": "clef-serve"}},
                "spec": {"groups": groups()}}
    PROMETHEUS_RULE.write_text(HEADER + yaml.safe_dump(document, sort_keys=False, width=100))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_deploy_alerts --write")
    write()

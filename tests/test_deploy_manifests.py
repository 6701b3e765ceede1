"""deploy/k8s/: valid against the Kubernetes schemas (kubernetes-validate bundles them, so this
runs offline) and consistent with the server's own settings and with each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from clef_frontend.cli import build_parser, config_from
from clef_frontend.server import FINAL_WRITE_SECONDS
from tests.conftest import REPO

K8S = REPO / "deploy" / "k8s"
# The oldest Kubernetes release still commonly run, and the newest the package knows.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path, document))
    return found


def by_kind(kind: str) -> dict[str, Any]:
    matches = [doc for _, doc in documents() if doc["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}"
    return matches[0]


def test_every_kind_is_shipped() -> None:
    kinds = sorted(doc["kind"] for _, doc in documents())
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(version: str) -> None:
    for path, document in documents():
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} ({document['kind']}) on {version}: {exc.message} at "
                        f"{list(exc.path)}")


def test_a_broken_manifest_is_caught() -> None:
    """The checker is really checking: a typo'd field and a wrong type are refused."""
    deployment = by_kind("Deployment")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[0], strict=True)


def container() -> dict[str, Any]:
    containers = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_the_pod_matches_the_server_settings() -> None:
    pod = by_kind("Deployment")["spec"]["template"]
    main = container()
    assert main["command"] == ["clef-serve"]
    config = config_from(build_parser().parse_args(main["args"]))
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": config.port, "metrics": config.metrics_port}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The startup probe outlasts the front's own start-up bound; readiness follows /health.
    startup = main["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.startup_timeout
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    # The kubelet waits longer than preStop plus the whole drain before SIGKILL.
    pre_stop = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = (float(pre_stop[1]) + config.drain_timeout + config.shutdown_grace
             + FINAL_WRITE_SECONDS)
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    # The model is mounted read-only, from a read-only claim.
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    model = config.worker_argv[config.worker_argv.index("--model") + 1]
    assert model.startswith(mounts["models"]["mountPath"] + "/")
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")
    assert claim["persistentVolumeClaim"]["readOnly"] is True


def test_service_and_budget_select_the_pods() -> None:
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = by_kind("Service")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    budget = by_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1

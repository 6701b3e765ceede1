"""deploy/k8s/: the kustomize base and every overlay render with `kubectl kustomize`, each
rendered object validates against the Kubernetes schemas (kubernetes-validate bundles them, so
this runs offline; custom resources it has no schema for are parsed and their kind and
apiVersion checked), and the objects agree with the server's settings and with each other."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from clef_frontend.cli import build_parser, config_from
from clef_frontend.server import FINAL_WRITE_SECONDS
from tests.deploy_tools import BASE, K8S, one, require_kustomize

OVERLAYS = sorted(path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml"))
KUSTOMIZATIONS = [BASE, *OVERLAYS]
# The oldest Kubernetes release still commonly run, and the newest the package knows.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# Custom resources (no schema in kubernetes-validate): the kinds the overlays may ship.
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    # The inference gateway (tests/gateway_schema.py checks them against the upstream types).
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("llm-d.ai/v1alpha2", "InferenceObjective"),
}
# Where the pod keeps what must survive it (TRITON_CACHE_DIR, XDG_CACHE_HOME).
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "XDG_CACHE_HOME")


def test_every_overlay_is_found() -> None:
    assert [path.name for path in OVERLAYS] == ["hpa", "inference-gateway",
                                                 "inference-gateway-keda", "keda", "monitoring",
                                                 "warm-cache"]


# -- the base's files, read directly (no kubectl needed) --------------------------------------

def base_documents() -> list[tuple[Path, dict[str, Any]]]:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml")
                                    if p.name != "kustomization.yaml"), "a file left out"
    found = []
    for name in listed:
        path = BASE / name
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found.append((path, document))
    return found


def base_kinds() -> list[dict[str, Any]]:
    return [doc for _, doc in base_documents()]


def test_every_base_kind_is_shipped() -> None:
    kinds = sorted(doc["kind"] for doc in base_kinds())
    assert kinds == ["Deployment", "NetworkPolicy", "PersistentVolumeClaim",
                     "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", VERSIONS)
def test_base_files_validate_strictly(version: str) -> None:
    for path, document in base_documents():
        try:
            kubernetes_validate.validate(document, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} ({document['kind']}) on {version}: {exc.message} at "
                        f"{list(exc.path)}")


def test_a_broken_manifest_is_caught() -> None:
    """The checker is really checking: a typo'd field and a wrong type are refused."""
    deployment = one(base_kinds(), "Deployment")
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[0], strict=True)


def container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(documents, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    main: dict[str, Any] = containers[0]
    return main


def server_config(main: dict[str, Any]) -> Any:
    args, unknown = build_parser().parse_known_args(main["args"])
    assert not unknown, f"flags clef-serve does not know: {unknown}"
    return config_from(args)


def test_the_pod_matches_the_server_settings() -> None:
    documents = base_kinds()
    pod = one(documents, "Deployment")["spec"]["template"]
    main = container(documents)
    assert main["command"] == ["clef-serve"]
    config = server_config(main)
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
    assert startup["periodSeconds"] * startup["failureThreshold"] >= config.workers.startup_timeout
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"
    # The kubelet waits longer than preStop plus the whole drain before SIGKILL.
    pre_stop = main["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = (float(pre_stop[1]) + config.drain_timeout + config.workers.shutdown_grace
             + FINAL_WRITE_SECONDS)
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    # The model is mounted read-only, from a read-only claim.
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    model = config.workers.worker_argv[config.workers.worker_argv.index("--model") + 1]
    assert model.startswith(mounts["models"]["mountPath"] + "/")
    claim = next(v for v in pod["spec"]["volumes"] if v["name"] == "models")
    assert claim["persistentVolumeClaim"]["readOnly"] is True


def test_service_and_budget_select_the_pods() -> None:
    documents = base_kinds()
    labels = one(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = one(documents, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    # The public Service carries HTTP only: the metrics port is never published through it.
    assert [port["targetPort"] for port in service["spec"]["ports"]] == ["http"]
    budget = one(documents, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] == 1


def volume_of(pod: dict[str, Any], main: dict[str, Any], path: str) -> tuple[dict[str, Any],
                                                                             dict[str, Any]]:
    """The mount holding `path` and its volume (the longest mount path that contains it)."""
    holding = [m for m in main["volumeMounts"]
               if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert holding, f"{path} is on no volume (the root filesystem is read-only)"
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    return mount, volume


def test_kernel_caches_outlive_the_pod() -> None:
    """TRITON_CACHE_DIR and XDG_CACHE_HOME sit on a claim, never an emptyDir, and the claim is
    shipped: a new pod finds the kernels the last one compiled."""
    documents = base_kinds()
    pod = one(documents, "Deployment")["spec"]["template"]
    main = container(documents)
    env = {e["name"]: e.get("value") for e in main["env"]}
    claims = {doc["metadata"]["name"]: doc for doc in documents
              if doc["kind"] == "PersistentVolumeClaim"}
    for variable in CACHE_VARIABLES:
        mount, volume = volume_of(pod, main, env[variable])
        assert "emptyDir" not in volume, f"{variable} is on an emptyDir: lost with the pod"
        name = volume["persistentVolumeClaim"]["claimName"]
        assert name in claims, f"{variable}: claim {name} is not shipped"
        assert not mount.get("readOnly", False)
        # Shared by every replica, so the claim must admit several nodes' pods.
        assert "ReadWriteMany" in claims[name]["spec"]["accessModes"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True


def test_api_keys_come_from_a_secret_that_can_change() -> None:
    """--api-key-file points into a Secret mounted as a directory: a Secret update reaches the
    file (a subPath mount never would) and the server re-reads it without a restart."""
    documents = base_kinds()
    pod = one(documents, "Deployment")["spec"]["template"]
    main = container(documents)
    key_file = server_config(main).api_key_file
    assert key_file is not None, "the pod must require API keys"
    mount, volume = volume_of(pod, main, key_file)
    assert "subPath" not in mount and "subPathExpr" not in mount
    assert mount["readOnly"] is True
    secret = volume["secret"]
    assert secret["secretName"] == "clef-serve-api-keys"
    assert not secret.get("optional", False), "a missing Secret must not start an open server"
    # The file name inside the Secret is the file the server reads.
    assert Path(key_file).parent == Path(mount["mountPath"])
    # No key text in the manifests: no Secret object ships with them.
    assert all(doc["kind"] != "Secret" for doc in documents)


def test_the_metrics_port_is_open_only_to_prometheus() -> None:
    documents = base_kinds()
    policy = one(documents, "NetworkPolicy")["spec"]
    labels = one(documents, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    rules_by_port: dict[str, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            rules_by_port.setdefault(port["port"], []).append(rule)
    assert set(rules_by_port) == {"http", "metrics"}
    # HTTP from anywhere the Service is reached from; metrics only from named peers.
    assert any("from" not in rule for rule in rules_by_port["http"])
    for rule in rules_by_port["metrics"]:
        assert rule.get("from"), "the metrics port must name who may scrape it"
        for peer in rule["from"]:
            assert "ipBlock" not in peer
            assert peer.get("podSelector", {}).get("matchLabels"), "any pod could scrape"


# -- every kustomization, rendered ------------------------------------------------------------

@cache
def rendered(directory: Path) -> list[dict[str, Any]]:
    kubectl = require_kustomize()
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def label(directory: Path) -> str:
    return str(directory.relative_to(K8S))


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=label)
def test_kustomization_renders_and_validates(directory: Path) -> None:
    documents = rendered(directory)
    assert documents, "rendered nothing"
    for document in documents:
        kind, api = document.get("kind"), document.get("apiVersion")
        name = document.get("metadata", {}).get("name")
        assert kind and api and name, f"object without kind, apiVersion or name: {document}"
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                assert (api, kind) in CUSTOM_KINDS, f"{api} {kind}: no schema, not a known CRD"
                assert isinstance(document.get("spec"), dict), f"{kind} {name}: no spec"
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{label(directory)}: {kind} {name} on {version}: {exc.message} "
                            f"at {list(exc.path)}")
    # Every overlay keeps the whole base.
    base = {(doc["kind"], doc["metadata"]["name"]) for doc in rendered(BASE)}
    assert base <= {(doc["kind"], doc["metadata"]["name"]) for doc in documents}


def monitoring_checks(documents: list[dict[str, Any]]) -> str:
    """The ServiceMonitor scrapes the pods' metrics port through a Service that selects them;
    the job label Prometheus then gives the series (the Service's name)."""
    deployment = one(documents, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    monitor = one(documents, "ServiceMonitor")["spec"]
    services = [doc for doc in documents if doc["kind"] == "Service"
                and monitor["selector"]["matchLabels"].items()
                <= doc["metadata"].get("labels", {}).items()]
    assert len(services) == 1, "the ServiceMonitor must select exactly one Service"
    service = services[0]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None", "one target per pod, not a balanced one"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    (endpoint,) = monitor["endpoints"]
    assert ports[endpoint["port"]]["targetPort"] == "metrics"
    assert endpoint["path"] == "/metrics"
    container_ports = {p["name"] for p in container(documents)["ports"]}
    assert "metrics" in container_ports
    job: str = service["metadata"]["name"]
    return job


def scaling_behaviour(behavior: dict[str, Any]) -> None:
    """Up at once, down slowly: a new pod needs a minute or more of warm-up."""
    down, up = behavior["scaleDown"], behavior["scaleUp"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert all(p["periodSeconds"] >= 120 and p["value"] == 1 for p in down["policies"])
    assert up["stabilizationWindowSeconds"] < down["stabilizationWindowSeconds"]


def test_monitoring_overlay_scrapes_the_metrics_port() -> None:
    documents = rendered(K8S / "overlays" / "monitoring")
    monitoring_checks(documents)
    assert one(documents, "Deployment")["spec"]["replicas"] >= 2


def test_keda_overlay_scales_on_outstanding_requests() -> None:
    documents = rendered(K8S / "overlays" / "keda")
    job = monitoring_checks(documents)
    deployment = one(documents, "Deployment")
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
    scaled = one(documents, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
    assert 2 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    query = trigger["metadata"]["query"]
    for metric in ("clef_queue_depth", "clef_requests_in_flight"):
        assert f'{metric}{{job="{job}"}}' in query, f"{metric} of this release's pods"
    assert float(trigger["metadata"]["threshold"]) > 0
    scaling_behaviour(scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"])


def test_hpa_overlay_scales_on_outstanding_requests() -> None:
    documents = rendered(K8S / "overlays" / "hpa")
    monitoring_checks(documents)
    deployment = one(documents, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    hpa = one(documents, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": deployment["metadata"]["name"]}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    names = {m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"}
    assert names == {"clef_queue_depth", "clef_requests_in_flight"}
    scaling_behaviour(hpa["behavior"])


def test_the_warm_cache_job_builds_the_pods_cache() -> None:
    """The Job runs `clef-serve warm-cache` with the pods' model flags, on the pods' image, GPU,
    model claim and cache claim, with the same cache variables: what it fills is what the pods
    read (the cache and the verdict are keyed by those flags)."""
    documents = rendered(K8S / "overlays" / "warm-cache")
    main = container(documents)
    job = one(documents, "Job")["spec"]["template"]["spec"]
    [warm] = job["containers"]
    assert warm["command"] == ["clef-serve"] and warm["args"][0] == "warm-cache"
    assert warm["image"] == main["image"]
    model_flags = {arg.split("=")[0] for arg in warm["args"][1:]}
    assert {"--model", "--device"} <= model_flags
    assert {arg for arg in main["args"] if arg.split("=")[0] in model_flags} == \
        set(warm["args"][1:])
    from clef_worker.main import parse_args

    parsed = parse_args([*warm["args"][1:], "--warm-only"])  # the worker takes every flag
    assert parsed.warm_only and parsed.model == "/models/clef-flash"
    env = {e["name"]: e.get("value") for e in warm["env"]}
    pod_env = {e["name"]: e.get("value") for e in main["env"]}
    for variable in (*CACHE_VARIABLES, "TRITON_HOME"):
        assert env[variable] == pod_env[variable]
    pod = one(documents, "Deployment")["spec"]["template"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    for mount in warm["volumeMounts"]:
        volume = next(v for v in job["volumes"] if v["name"] == mount["name"])
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] == claims[mount["name"]]
    assert warm["resources"]["limits"]["nvidia.com/gpu"] == \
        main["resources"]["limits"]["nvidia.com/gpu"]

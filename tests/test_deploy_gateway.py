"""deploy/k8s/components/inference-gateway (and its KEDA option): rendered with `kubectl
kustomize`, every gateway object checked against the upstream types (tests/gateway_schema.py),
and the objects agreeing with the clef-serve Deployment and with what a real front exports."""

from __future__ import annotations

import copy
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from clef_frontend.metrics import LOAD_PATH
from tests.frontend_helpers import Serve
from tests.gateway_schema import (
    check_inference_objective,
    check_inference_pool,
    check_picker_config,
    duration_seconds,
    metric_name,
    plugin_names,
)
from tests.test_deploy_manifests import K8S, container, one, rendered, server_config
from tests.test_observability import parse_metrics

GATEWAY = K8S / "overlays" / "inference-gateway"
GATEWAY_KEDA = K8S / "overlays" / "inference-gateway-keda"
OVERLAYS = [GATEWAY, GATEWAY_KEDA]
PICKER = "clef-serve-epp"
CHECKS = {"InferencePool": check_inference_pool, "InferenceObjective": check_inference_objective}


def named(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def clef_deployment(documents: list[dict[str, Any]]) -> dict[str, Any]:
    return named(documents, "Deployment", "clef-serve")


def picker_deployment(documents: list[dict[str, Any]]) -> dict[str, Any]:
    return named(documents, "Deployment", PICKER)


def picker_args(documents: list[dict[str, Any]]) -> dict[str, str]:
    (main,) = picker_deployment(documents)["spec"]["template"]["spec"]["containers"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in main["args"])


def picker_config(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The EndpointPickerConfig the picker reads: the file --config-file names, in the
    ConfigMap mounted at that directory."""
    pod = picker_deployment(documents)["spec"]["template"]["spec"]
    path = Path(picker_args(documents)["config-file"])
    (main,) = pod["containers"]
    mount = next(m for m in main["volumeMounts"] if Path(m["mountPath"]) == path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = named(documents, "ConfigMap", volume["configMap"]["name"])
    loaded: dict[str, Any] = yaml.safe_load(config_map["data"][path.name])
    return loaded


def plugin(config: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found


def clef_container(documents: list[dict[str, Any]]) -> dict[str, Any]:
    return container([clef_deployment(documents)])


# -- every object, against the upstream types ------------------------------------------------------


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda d: d.name)
def test_every_gateway_object_passes_the_upstream_checks(directory: Path) -> None:
    documents = rendered(directory)
    kinds = [d["kind"] for d in documents]
    assert kinds.count("InferencePool") == 1
    assert kinds.count("InferenceObjective") == 2
    problems = [problem for d in documents if d["kind"] in CHECKS
                for problem in CHECKS[d["kind"]](d)]
    problems += check_picker_config(picker_config(documents))
    assert problems == []


def test_the_checks_refuse_broken_objects() -> None:
    """The checker is really checking: each broken copy is refused, naming the field."""
    documents = rendered(GATEWAY)
    pool = one(documents, "InferencePool")
    objective = next(d for d in documents if d["kind"] == "InferenceObjective")
    config = picker_config(documents)

    def broken(original: dict[str, Any], path: list[Any], value: Any) -> dict[str, Any]:
        copied = copy.deepcopy(original)
        target: Any = copied
        for key in path[:-1]:
            target = target[key]
        if value is None:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return copied

    def refused(problems: list[str], naming: str) -> bool:
        return any(naming in problem for problem in problems)

    assert refused(check_inference_pool(broken(pool, ["spec", "targetPorts"], None)),
                   "targetPorts")
    assert refused(check_inference_pool(broken(pool, ["spec", "targetPorts"],
                                               [{"number": 70000}])), "70000")
    assert refused(check_inference_pool(broken(pool, ["spec", "endpointPickerRef",
                                                      "failureMode"], "Sometimes")),
                   "failureMode")
    assert refused(check_inference_pool(broken(pool, ["spec", "endpointPickerRef", "port"],
                                               None)), "port is required")
    # v1alpha2's field, gone in v1.
    assert refused(check_inference_pool(broken(pool, ["spec", "targetPortNumber"], 8000)),
                   "targetPortNumber")
    assert refused(check_inference_pool(broken(
        pool, ["apiVersion"], "inference.networking.x-k8s.io/v1alpha2")), "expected")
    assert refused(check_inference_objective(broken(objective, ["spec", "poolRef"], None)),
                   "poolRef")
    assert refused(check_inference_objective(broken(objective, ["spec", "priority"], "high")),
                   "int32")
    assert refused(check_inference_objective(broken(objective, ["spec", "criticality"],
                                                    "Critical")), "criticality")
    assert refused(check_picker_config(broken(config, ["plugins"], [
        *config["plugins"], {"type": "no-such-plugin"}])), "not registered")
    assert refused(check_picker_config(broken(config, ["requestHandler", "parsers"],
                                              [{"pluginRef": "openai-parser"}])), "undefined")
    assert refused(check_picker_config(broken(config, ["featureGates"], ["flowControll"])),
                   "feature gate")
    detector = next(i for i, p in enumerate(config["plugins"])
                    if p["type"] == "utilization-detector")
    assert refused(check_picker_config(broken(config, ["plugins", detector, "parameters",
                                                      "kvCacheUtilThreshold"], 1.5)),
                   "kvCacheUtilThreshold")


# -- the pool and the pods ------------------------------------------------------------------------


def test_the_pool_selects_the_clef_pods_on_their_http_port() -> None:
    documents = rendered(GATEWAY)
    pool = one(documents, "InferencePool")["spec"]
    deployment = clef_deployment(documents)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    # The picker's pods are not in the pool.
    picker_labels = picker_deployment(documents)["spec"]["template"]["metadata"]["labels"]
    assert not pool["selector"]["matchLabels"].items() <= picker_labels.items()
    main = clef_container(documents)
    config = server_config(main)
    http = {p["name"]: p["containerPort"] for p in main["ports"]}["http"]
    assert [port["number"] for port in pool["targetPorts"]] == [http] == [config.port]
    # Only Ready pods get traffic: the pods have a readiness probe on /health.
    assert main["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_pool_names_the_pickers_service_and_grpc_port() -> None:
    documents = rendered(GATEWAY)
    ref = one(documents, "InferencePool")["spec"]["endpointPickerRef"]
    service = named(documents, "Service", ref["name"])["spec"]
    port = next(p for p in service["ports"] if p["port"] == ref["port"]["number"])
    assert port["appProtocol"] == "kubernetes.io/h2c"
    (main,) = picker_deployment(documents)["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert container_ports[port["targetPort"]] == int(picker_args(documents)["grpc-port"])
    pod_labels = picker_deployment(documents)["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()


def test_the_pods_carry_the_engine_type_the_extractor_maps() -> None:
    documents = rendered(GATEWAY)
    extractor = plugin(picker_config(documents), "core-metrics-extractor")["parameters"]
    labels = clef_deployment(documents)["spec"]["template"]["metadata"]["labels"]
    engine = labels[extractor["engineLabelKey"]]
    assert engine == extractor["defaultEngine"] == "clef"
    assert engine in [e["name"] for e in extractor["engineConfigs"]]


def test_the_local_queue_is_shallow_and_deeper_than_the_pickers_threshold() -> None:
    """Priorities are decided in the picker: a replica queues only what arrives within a
    scrape or two of saturating (beyond the picker's threshold), never a long backlog."""
    documents = rendered(GATEWAY)
    config = server_config(clef_container(documents))
    detector = plugin(picker_config(documents), "utilization-detector")["parameters"]
    assert detector["queueDepthThreshold"] < config.queue_size <= 16
    assert 0 < detector["kvCacheUtilThreshold"] <= 1


# -- the picker's configuration -------------------------------------------------------------------


def test_the_picker_forwards_any_path_and_reads_the_metrics_port() -> None:
    documents = rendered(GATEWAY)
    config = picker_config(documents)
    assert "passthrough-parser" in plugin_names(config).values()
    assert [p["pluginRef"] for p in config["requestHandler"]["parsers"]] == [
        next(n for n, t in plugin_names(config).items() if t == "passthrough-parser")]
    source = plugin(config, "metrics-data-source")["parameters"]
    server = server_config(clef_container(documents))
    assert source["port"] == server.metrics_port and source["path"] == LOAD_PATH
    # The NetworkPolicy lets the picker's pods reach that port.
    policy = named(documents, "NetworkPolicy", "clef-serve")["spec"]
    picker_labels = picker_deployment(documents)["spec"]["template"]["metadata"]["labels"]
    allowed = [rule for rule in policy["ingress"]
               if any(p["port"] == "metrics" for p in rule["ports"])
               and any(peer.get("podSelector", {}).get("matchLabels", {}).items()
                       <= picker_labels.items() and "namespaceSelector" not in peer
                       for peer in rule.get("from", []))]
    assert allowed, "the picker cannot scrape the pods' metrics port"


def test_metrics_are_fresh_enough_for_the_saturation_detector() -> None:
    documents = rendered(GATEWAY)
    args = picker_args(documents)
    detector = plugin(picker_config(documents), "utilization-detector")["parameters"]
    refresh = duration_seconds(args["refresh-metrics-interval"])
    stale = duration_seconds(detector["metricsStalenessThreshold"])
    assert refresh == 0.05 and stale == 0.2
    assert refresh * 3 <= stale, "a single late scrape must not mark a pod saturated"


def test_flow_control_has_a_band_per_objective_and_the_pods_map_them() -> None:
    documents = rendered(GATEWAY)
    config = picker_config(documents)
    assert "flowControl" in config["featureGates"]
    detector = config["flowControl"]["saturationDetector"]["pluginRef"]
    assert plugin_names(config)[detector] == "utilization-detector"
    pool = one(documents, "InferencePool")["metadata"]["name"]
    objectives = {d["metadata"]["name"]: d["spec"] for d in documents
                  if d["kind"] == "InferenceObjective"}
    assert all(spec["poolRef"]["name"] == pool for spec in objectives.values())
    bands = {band["priority"] for band in config["flowControl"]["priorityBands"]}
    assert bands == {spec["priority"] for spec in objectives.values()}
    # The pods map the same names to clef's classes: the higher priority is interactive.
    mapped = dict(server_config(clef_container(documents)).objective_classes)
    assert set(mapped) == set(objectives)
    ranked = sorted(objectives, key=lambda name: objectives[name]["priority"])
    assert [mapped[name] for name in ranked] == ["bulk", "interactive"]


def test_the_picker_can_watch_what_it_needs() -> None:
    documents = rendered(GATEWAY)
    pod = picker_deployment(documents)["spec"]["template"]["spec"]
    binding = named(documents, "RoleBinding", PICKER)
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"]} in binding["subjects"]
    named(documents, "ServiceAccount", pod["serviceAccountName"])
    rules = named(documents, "Role", binding["roleRef"]["name"])["rules"]
    granted = {(group, resource) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] if {"get", "watch", "list"} <= set(rule["verbs"])}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
            ("llm-d.ai", "inferenceobjectives")} <= granted
    assert picker_args(documents)["pool-name"] == one(documents, "InferencePool")["metadata"][
        "name"]


def test_the_three_metric_names_are_what_a_real_front_exports() -> None:
    """Each spec names a gauge a running front exports as one unlabelled series (a picker spec
    without labels must match exactly one), at the path the picker scrapes on the metrics port
    (exactly those three there) and in the full /metrics. The front runs with its defaults but
    the metrics port, which the manifests give it."""
    config = picker_config(rendered(GATEWAY))
    extractor = plugin(config, "core-metrics-extractor")["parameters"]
    path = plugin(config, "metrics-data-source")["parameters"]["path"]
    (clef,) = [e for e in extractor["engineConfigs"] if e["name"] == "clef"]
    names = [metric_name(clef[field]) for field in ("queuedRequestsSpec", "runningRequestsSpec",
                                                    "kvUsageSpec")]
    assert len(set(names)) == 3
    with Serve(front_args=("--metrics-port", "0"), max_batch=None) as serve:
        port = int(serve.wait_for(r"metrics on http://[^\s:]+:(\d+)/metrics")[1])
        scraped = {}
        for where in (path, "/metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{where}", timeout=10) as answer:
                scraped[where] = parse_metrics(answer.read().decode())
    assert {sample for sample, _ in scraped[path]} == set(names)
    for samples in scraped.values():
        for name in names:
            series = [labels for (sample, labels) in samples if sample == name]
            assert series == [frozenset()], f"{name}: {series}"


# -- KEDA on the picker's pool metrics -------------------------------------------------------------


def test_keda_scales_the_clef_pods_on_the_pickers_pool_saturation() -> None:
    documents = rendered(GATEWAY_KEDA)
    deployment = clef_deployment(documents)
    assert "replicas" not in deployment["spec"], "KEDA owns the replica count"
    scaled = one(documents, "ScaledObject")["spec"]
    assert scaled["scaleTargetRef"]["name"] == "clef-serve"
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    query = trigger["metadata"]["query"]
    pool = one(documents, "InferencePool")["metadata"]["name"]
    assert "llm_d_epp_flow_control_pool_saturation{" in query
    assert f'inference_pool="{pool}"' in query and 'stage="effective"' in query
    assert 0 < float(trigger["metadata"]["threshold"]) <= 1
    # Prometheus scrapes the picker's Service (its name is the job label the query reads).
    monitors = [d for d in documents if d["kind"] == "ServiceMonitor"
                and d["metadata"]["name"] == PICKER]
    (monitor,) = monitors
    service = named(documents, "Service", PICKER)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    assert f'job="{service["metadata"]["name"]}"' in query
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}

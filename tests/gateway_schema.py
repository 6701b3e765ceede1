"""Offline checks of the inference gateway's objects, written from the upstream Go types.

kubernetes-validate knows only Kubernetes' own kinds, so the custom resources and the endpoint
picker's configuration of deploy/k8s/components/inference-gateway are checked here, field by
field, against what was read in the upstream sources (no upstream file is copied):

- `InferencePool`, group `inference.networking.k8s.io`, version `v1`
  (kubernetes-sigs/gateway-api-inference-extension, api/v1/inferencepool_types.go and
  shared_types.go, snapshot of 2026-08-18): spec.selector.matchLabels (1-64 labels, label key
  and value patterns), spec.targetPorts (1-8 unique ports 1-65535), spec.appProtocol (`http`,
  `kubernetes.io/h2c`), spec.endpointPickerRef (name required; kind defaults to Service and a
  Service needs port; failureMode `FailOpen`/`FailClose`).
- `InferenceObjective`, group `llm-d.ai`, version `v1alpha2` (llm-d/llm-d-router,
  config/crd/bases/llm-d.ai_inferenceobjectives.yaml, snapshot of 2026-08-22): spec.poolRef
  (name required, group and kind patterns), spec.priority (int32).
- `EndpointPickerConfig`, `llm-d.ai/v1alpha1` (llm-d/llm-d-router,
  apix/config/v1alpha1/endpointpickerconfig_types.go; the loader's validation.go; plugin
  factories): the top-level fields, plugins (type required and registered, names unique,
  defaulting to the type), scheduling profiles, parser, data-layer and saturation-detector
  references, feature gates, priority bands, and the parameters of the plugins used here.

Each check returns a list of problems (empty: valid), so a test can show all of them at once
and can prove the checker refuses broken objects.
"""

from __future__ import annotations

import re
from typing import Any

POOL_API = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
OBJECTIVE_API = "llm-d.ai/v1alpha2"
PICKER_CONFIG_API = "llm-d.ai/v1alpha1"

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")
_GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
_QUANTITY = re.compile(r"^\d+(\.\d+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")

# Plugin types registered in the llm-d router (the `...Type` constants of its plugin packages)
# that this project may name; a type outside this list is refused, as the picker's loader
# refuses an unregistered one.
PLUGIN_TYPES = frozenset({
    # request handling
    "passthrough-parser", "openai-parser",
    # data layer
    "metrics-data-source", "core-metrics-extractor",
    # flow control
    "utilization-detector", "concurrency-detector", "global-strict-fairness-policy",
    "round-robin-fairness-policy", "fcfs-ordering-policy", "edf-ordering-policy",
    "static-usage-limit-policy",
    # scheduling
    "queue-scorer", "kv-cache-utilization-scorer", "running-requests-size-scorer",
    "active-request-scorer", "load-aware-scorer", "max-score-picker", "random-picker",
    "single-profile-handler",
})
FEATURE_GATES = frozenset({"flowControl"})
_TOP_LEVEL = frozenset({"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
                        "dataLayer", "flowControl", "requestHandler", "saturationDetector",
                        "parser"})
_FLOW_CONTROL = frozenset({"maxBytes", "maxRequests", "defaultRequestTTL",
                           "noEndpointRequestTTL", "defaultPriorityBand",
                           "defaultNegativePriorityBand", "priorityBands",
                           "usageLimitPolicyPluginRef", "saturationDetector", "enableEviction"})
_BAND = frozenset({"priority", "maxBytes", "maxRequests", "fairnessPolicyRef",
                   "orderingPolicyRef"})
# Engines the core-metrics-extractor knows without configuration (its defaultEngineConfigs).
BUILTIN_ENGINES = frozenset({"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "triton"})
_ENGINE_FIELDS = frozenset({"name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec",
                            "loraSpec", "cacheInfoSpec", "cacheBlockSizeLabelName",
                            "cacheNumBlocksLabelName", "cacheBlockSizeSpec",
                            "cacheNumBlocksSpec", "customMetrics"})
# A metric spec: a metric name, optionally with {label=value,...} (the extractor's spec.go).
_METRIC_SPEC = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^{}]*\})?$")


def _unknown(found: dict[str, Any], allowed: frozenset[str], where: str) -> list[str]:
    return [f"{where}: unknown field {name!r}" for name in sorted(set(found) - allowed)]


def _port_number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def _resource(obj: dict[str, Any], api: str, kind: str,
              spec_fields: frozenset[str]) -> tuple[str, list[str], dict[str, Any] | None]:
    """What every custom resource needs: its apiVersion and kind, a name, a spec object with
    only known fields. Returns the object's label for messages, the problems, and the spec."""
    name = obj.get("metadata", {}).get("name")
    where = f"{kind} {name}"
    problems = [] if isinstance(name, str) and name else [f"{where}: metadata.name is required"]
    if obj.get("apiVersion") != api or obj.get("kind") != kind:
        problems.append(f"{where}: expected {api} {kind}")
    problems += _unknown(obj, frozenset({"apiVersion", "kind", "metadata", "spec", "status"}),
                         where)
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return where, [*problems, f"{where}: spec is required"], None
    return where, problems + _unknown(spec, spec_fields, f"{where}.spec"), spec


def check_inference_pool(obj: dict[str, Any]) -> list[str]:
    """Problems with an InferencePool (inference.networking.k8s.io/v1), if any."""
    where, problems, spec = _resource(obj, POOL_API, "InferencePool", frozenset({
        "selector", "targetPorts", "appProtocol", "endpointPickerRef"}))
    if spec is None:
        return problems
    selector = spec.get("selector")
    if not isinstance(selector, dict):
        problems.append(f"{where}: spec.selector is required")
    else:
        problems += _unknown(selector, frozenset({"matchLabels"}), f"{where}.spec.selector")
        labels = selector.get("matchLabels")
        if not isinstance(labels, dict) or not 1 <= len(labels) <= 64:
            problems.append(f"{where}: spec.selector.matchLabels needs 1 to 64 labels")
        else:
            for key, value in labels.items():
                if not (isinstance(key, str) and len(key) <= 253 and _LABEL_KEY.match(key)):
                    problems.append(f"{where}: label key {key!r} is invalid")
                if not (isinstance(value, str) and len(value) <= 63
                        and _LABEL_VALUE.match(value)):
                    problems.append(f"{where}: label value {value!r} is invalid")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        problems.append(f"{where}: spec.targetPorts needs 1 to 8 ports")
    else:
        numbers = []
        for port in ports:
            if not isinstance(port, dict) or set(port) != {"number"}:
                problems.append(f"{where}: a target port is {{number: N}}, got {port!r}")
            elif not _port_number(port["number"]):
                problems.append(f"{where}: port {port['number']!r} is not 1-65535")
            else:
                numbers.append(port["number"])
        if len(numbers) != len(set(numbers)):
            problems.append(f"{where}: port number must be unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        problems.append(f"{where}: appProtocol {spec['appProtocol']!r} is not an allowed value")
    ref = spec.get("endpointPickerRef")
    if ref is not None:
        problems += _picker_ref(ref, f"{where}.spec.endpointPickerRef")
    return problems


def _picker_ref(ref: Any, where: str) -> list[str]:
    if not isinstance(ref, dict):
        return [f"{where}: must be an object"]
    problems = _unknown(ref, frozenset({"group", "kind", "name", "port", "failureMode"}), where)
    name = ref.get("name")
    if not (isinstance(name, str) and 1 <= len(name) <= 253):
        problems.append(f"{where}: name is required")
    if not _GROUP.match(str(ref.get("group", ""))):
        problems.append(f"{where}: group {ref['group']!r} is invalid")
    kind = ref.get("kind", "Service")
    if not (isinstance(kind, str) and len(kind) <= 63 and _KIND.match(kind)):
        problems.append(f"{where}: kind {kind!r} is invalid")
    port = ref.get("port")
    if kind == "Service" and port is None:
        problems.append(f"{where}: port is required when kind is 'Service' or unspecified")
    if port is not None and not (isinstance(port, dict) and set(port) == {"number"}
                                 and _port_number(port["number"])):
        problems.append(f"{where}: port must be {{number: 1-65535}}, got {port!r}")
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        problems.append(f"{where}: failureMode {ref['failureMode']!r} is not FailOpen/FailClose")
    return problems


def check_inference_objective(obj: dict[str, Any]) -> list[str]:
    """Problems with an InferenceObjective (llm-d.ai/v1alpha2), if any."""
    where, problems, spec = _resource(obj, OBJECTIVE_API, "InferenceObjective",
                                      frozenset({"poolRef", "priority"}))
    if spec is None:
        return problems
    priority = spec.get("priority")
    if priority is not None and not (isinstance(priority, int) and not isinstance(priority, bool)
                                     and -2**31 <= priority < 2**31):
        problems.append(f"{where}: priority must be an int32, got {priority!r}")
    ref = spec.get("poolRef")
    if not isinstance(ref, dict):
        return [*problems, f"{where}: spec.poolRef is required"]
    problems += _unknown(ref, frozenset({"group", "kind", "name"}), f"{where}.spec.poolRef")
    name = ref.get("name")
    if not (isinstance(name, str) and 1 <= len(name) <= 253):
        problems.append(f"{where}: poolRef.name is required")
    group = ref.get("group", POOL_GROUP)
    if not (isinstance(group, str) and len(group) <= 253 and _GROUP.match(group)):
        problems.append(f"{where}: poolRef.group {group!r} is invalid")
    kind = ref.get("kind", "InferencePool")
    if not (isinstance(kind, str) and 1 <= len(kind) <= 63 and _KIND.match(kind)):
        problems.append(f"{where}: poolRef.kind {kind!r} is invalid")
    return problems


# -- EndpointPickerConfig --------------------------------------------------------------------------


def plugin_names(config: dict[str, Any]) -> dict[str, str]:
    """Each plugin's name (its type when unnamed, as the loader defaults it) and its type."""
    return {str(plugin.get("name") or plugin.get("type")): str(plugin.get("type"))
            for plugin in config.get("plugins") or [] if isinstance(plugin, dict)}


def check_picker_config(config: dict[str, Any]) -> list[str]:
    """Problems with an EndpointPickerConfig (llm-d.ai/v1alpha1), if any."""
    where = "EndpointPickerConfig"
    problems = []
    if config.get("apiVersion") != PICKER_CONFIG_API or config.get("kind") != where:
        problems.append(f"{where}: expected {PICKER_CONFIG_API} {where}")
    problems += _unknown(config, _TOP_LEVEL, where)
    for gate in config.get("featureGates") or []:
        name, _, value = str(gate).partition("=")
        if name not in FEATURE_GATES or value not in ("", "true", "false"):
            problems.append(f"{where}: feature gate {gate!r} is unknown")
    plugins = config.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        return [*problems, f"{where}: plugins is required"]
    seen: set[str] = set()
    for plugin in plugins:
        if not isinstance(plugin, dict) or not plugin.get("type"):
            problems.append(f"{where}: plugin {plugin!r} is missing a type")
            continue
        problems += _unknown(plugin, frozenset({"name", "type", "parameters"}), where)
        name = plugin.get("name") or plugin["type"]
        if name in seen:
            problems.append(f"{where}: duplicate plugin name {name!r}")
        seen.add(name)
        if plugin["type"] not in PLUGIN_TYPES:
            problems.append(f"{where}: plugin type {plugin['type']!r} is not registered")
        problems += _parameters(plugin["type"], plugin.get("parameters"), f"{where} {name}")
    defined = plugin_names(config)

    def ref(value: Any, at: str) -> None:
        if value not in defined:
            problems.append(f"{where}: {at} references undefined plugin {value!r}")

    profiles = config.get("schedulingProfiles")
    if not isinstance(profiles, list) or not profiles:
        problems.append(f"{where}: schedulingProfiles is required")
    else:
        names: set[str | None] = set()
        for i, profile in enumerate(profiles):
            profile_name: str | None = profile.get("name") if isinstance(profile, dict) else None
            if not profile_name or profile_name in names:
                problems.append(f"{where}: schedulingProfiles[{i}] needs a unique name")
            names.add(profile_name)
            for j, entry in enumerate((profile or {}).get("plugins") or []):
                problems += _unknown(entry, frozenset({"pluginRef", "weight"}), where)
                ref(entry.get("pluginRef"), f"schedulingProfiles[{profile_name}].plugins[{j}]")
                weight = entry.get("weight")
                if weight is not None and not isinstance(weight, int | float):
                    problems.append(f"{where}: weight {weight!r} is not a number")
    handler = config.get("requestHandler") or {}
    problems += _unknown(handler, frozenset({"parsers"}), f"{where}.requestHandler")
    for parser in handler.get("parsers") or []:
        ref(parser.get("pluginRef"), "requestHandler.parsers")
    layer = config.get("dataLayer") or {}
    for source in layer.get("sources") or []:
        ref(source.get("pluginRef"), "dataLayer.sources")
        if not source.get("extractors"):
            problems.append(f"{where}: dataLayer source {source.get('pluginRef')} needs extractors")
        for extractor in source.get("extractors") or []:
            ref(extractor.get("pluginRef"), "dataLayer.sources.extractors")
    flow = config.get("flowControl")
    if flow is not None:
        problems += _flow_control(flow, defined, f"{where}.flowControl")
    return problems


def _flow_control(flow: dict[str, Any], defined: dict[str, str], where: str) -> list[str]:
    problems = _unknown(flow, _FLOW_CONTROL, where)
    detector = (flow.get("saturationDetector") or {}).get("pluginRef")
    if detector is not None and detector not in defined:
        problems.append(f"{where}: saturationDetector references undefined plugin {detector!r}")
    for name in ("defaultRequestTTL", "noEndpointRequestTTL"):
        if name in flow and not _GO_DURATION.match(str(flow[name])):
            problems.append(f"{where}: {name} {flow[name]!r} is not a duration")
    for name in ("maxBytes", "maxRequests"):
        if name in flow and not _QUANTITY.match(str(flow[name])):
            problems.append(f"{where}: {name} {flow[name]!r} is not a quantity")
    bands = [*(flow.get("priorityBands") or []),
             *(b for b in (flow.get("defaultPriorityBand"),
                           flow.get("defaultNegativePriorityBand")) if b)]
    for band in bands:
        problems += _unknown(band, _BAND, f"{where} band")
        if not isinstance(band.get("priority", 0), int):
            problems.append(f"{where}: band priority {band.get('priority')!r} is not an int")
        for name in ("maxBytes", "maxRequests"):
            if name in band and not _QUANTITY.match(str(band[name])):
                problems.append(f"{where}: band {name} {band[name]!r} is not a quantity")
    priorities = [band.get("priority") for band in flow.get("priorityBands") or []]
    if len(priorities) != len(set(priorities)):
        problems.append(f"{where}: two priority bands share a priority")
    return problems


def _parameters(kind: str, parameters: Any, where: str) -> list[str]:
    """The parameters of the plugin types whose factories were read (others: any object)."""
    if parameters is None:
        return []
    if not isinstance(parameters, dict):
        return [f"{where}: parameters must be an object"]
    if kind == "passthrough-parser":
        return [f"{where}: passthrough-parser takes no parameters"] if parameters else []
    if kind == "utilization-detector":
        return _detector(parameters, where)
    if kind == "metrics-data-source":
        return _metrics_source(parameters, where)
    if kind == "core-metrics-extractor":
        return _extractor(parameters, where)
    return []


def _detector(p: dict[str, Any], where: str) -> list[str]:
    problems = _unknown(p, frozenset({"queueDepthThreshold", "kvCacheUtilThreshold",
                                      "metricsStalenessThreshold", "headroom"}), where)
    depth = p.get("queueDepthThreshold", 5)
    if not (isinstance(depth, int) and depth > 0):
        problems.append(f"{where}: queueDepthThreshold must be strictly positive")
    usage = p.get("kvCacheUtilThreshold", 0.8)
    if not (isinstance(usage, int | float) and 0.0 < usage <= 1.0):
        problems.append(f"{where}: kvCacheUtilThreshold must be in (0.0, 1.0]")
    stale = str(p.get("metricsStalenessThreshold", "200ms"))
    if not _GO_DURATION.match(stale) or duration_seconds(stale) <= 0:
        problems.append(f"{where}: metricsStalenessThreshold must be a positive duration")
    headroom = p.get("headroom", 0.0)
    if not (isinstance(headroom, int | float) and headroom >= 0):
        problems.append(f"{where}: headroom must be non-negative")
    return problems


def _metrics_source(p: dict[str, Any], where: str) -> list[str]:
    problems = _unknown(p, frozenset({"scheme", "path", "port", "insecureSkipVerify",
                                      "caCertPath", "clientCertPath", "clientKeyPath",
                                      "interval"}), where)
    if p.get("scheme", "http") not in ("http", "https"):
        problems.append(f"{where}: scheme must be http or https")
    if not str(p.get("path", "/metrics")).startswith("/"):
        problems.append(f"{where}: path must start with /")
    if "port" in p and not _port_number(p["port"]):
        problems.append(f"{where}: port must be between 1 and 65535")
    if "interval" in p and not _GO_DURATION.match(str(p["interval"])):
        problems.append(f"{where}: interval {p['interval']!r} is not a duration")
    return problems


def _extractor(p: dict[str, Any], where: str) -> list[str]:
    problems = _unknown(p, frozenset({"engineLabelKey", "defaultEngine", "engineConfigs"}), where)
    names = set(BUILTIN_ENGINES)
    for engine in p.get("engineConfigs") or []:
        problems += _unknown(engine, _ENGINE_FIELDS, f"{where} engine")
        name = engine.get("name")
        if not name or name == "default":
            problems.append(f"{where}: engine config name {name!r} is empty or reserved")
        names.add(name)
        for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
            if field in engine and not _METRIC_SPEC.match(str(engine[field])):
                problems.append(f"{where}: {field} {engine[field]!r} is not a metric spec")
    if p.get("defaultEngine", "vllm") not in names:
        problems.append(f"{where}: defaultEngine {p['defaultEngine']!r} not found in "
                        "engineConfigs")
    key = p.get("engineLabelKey", "llm-d.ai/engine-type")
    if not _LABEL_KEY.match(str(key)):
        problems.append(f"{where}: engineLabelKey {key!r} is not a label key")
    return problems


def duration_seconds(text: str) -> float:
    """A Go duration ("200ms", "1m30s") in seconds."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(number) * units[unit]
               for number, _, unit in re.findall(r"(\d+(\.\d+)?)(ns|us|µs|ms|s|m|h)", text))


def metric_name(spec: str) -> str:
    """The metric a spec reads (`name{label=value}` -> `name`)."""
    return spec.split("{", 1)[0]

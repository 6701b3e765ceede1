"""Every frame of the channel, both ways, as typed values with strict decoding.

Worker -> front: `ready` (once, after warm-up), `fatal` (could not start), `response` and `error`
(one per request, both decoded as one `WorkerReply`), `pong` (one per `ping`, sent between
forwards). Front -> worker: `request`, `ping` (liveness: a worker that neither answers pings nor
completes forwards is wedged), `shutdown`. `from_worker` and `from_front` turn a decoded frame
into its value or raise `ProtocolError` (an unknown kind, a missing or mistyped field): each side
trusts nothing the other writes. The constructors below (`request`, `response`, ...) are the
only way frames are built, so the field names live here alone.

Three ids, one name each: `id` is the int frame id, chosen by the front per request sent and
echoed by the worker, so a reply can never be matched to the wrong request; `request_id` is the
client's request id (`X-Request-Id`, or one the front made); `trace_id` is the W3C trace id (32
hex digits, empty when the request is not traced). The worker puts the last two on every log
line about the request, so its lines join both the access log and the trace.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from clef_protocol.errors import ProtocolError

READY = "ready"
FATAL = "fatal"
REQUEST = "request"
RESPONSE = "response"
ERROR = "error"
SHUTDOWN = "shutdown"
PING = "ping"
PONG = "pong"

# The request id rule (`X-Request-Id`, the `request_id` of a request frame): printable ASCII
# without spaces, so it stays one token in a `key=value` log line, and bounded.
REQUEST_ID_MAX_CHARS = 128


def is_request_id(value: object) -> bool:
    """Whether `value` may be used as a request id as it is (else the front makes one)."""
    return (isinstance(value, str) and 0 < len(value) <= REQUEST_ID_MAX_CHARS
            and all("!" <= ch <= "~" for ch in value))


def is_trace_id(value: object) -> bool:
    """Whether `value` is a W3C trace id: 32 lower-case hex digits, not all zero."""
    return (isinstance(value, str) and len(value) == 32 and value != "0" * 32
            and all(ch in "0123456789abcdef" for ch in value))


# The signal on which a worker writes every thread's Python stack to its stderr (`faulthandler`)
# and then exits (SIGUSR1's default action, which faulthandler chains to): the front sends it to
# a worker it is about to kill as hung or stalled, so the log says where the worker was stuck,
# and SIGKILLs it only if it is still there `STACK_DUMP_SECONDS` later. gunicorn's
# SIGABRT-then-SIGKILL, without SIGABRT's core file (gigabytes for a GPU process); and since
# the worker exits once the stack is out, the replacement is not held up by a fixed wait.
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_SECONDS = 2.0

# The front's pid, in every worker's environment: the worker asks the kernel to kill it when its
# parent dies (clef_worker.parent) and, where its parent is not this pid, checks the front is
# still alive, so a front killed before the worker made that request leaves no orphan behind.
FRONT_PID_ENV = "CLEF_FRONT_PID"


# The `detail` of every 5xx a client sees for a request the worker could not answer (the
# contract's text, sent by the worker in its `error` frames and by the front when it loses the
# request; the cause goes to the log only).
INFERENCE_FAILED = "inference failed"

# Worker exit statuses the front tells apart (restart reasons in its metrics and logs).
EXIT_PROTOCOL_ERROR = 2  # the front sent something the worker cannot read
EXIT_EXECUTOR_BROKEN = 3  # a sticky device error (CUDA) left the executor unusable


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded executor says about its model and how it runs (`ready`, logs, `/health`)."""

    model: str
    variant: str
    device: str
    dtype: str
    gdn_path: str
    # The Gated DeltaNet short convolution (clef_worker.model.short_conv): fla-triton or
    # torch; empty for an executor that does not choose it (the release executor runs its own code).
    short_conv: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    demo: bool = False
    snapshot: str = ""
    # A digest of the snapshot's files as loaded (names, sizes and contents): the same path with
    # other weights has another fingerprint, so the front's kept answers can follow the weights.
    fingerprint: str = ""
    # The GPU path (clef_worker.serving.gpu.graphs): length buckets (padded: a row's length;
    # packed: a forward's total tokens), whether they replay captured CUDA graphs, how many shapes
    # were
    # built at warm-up and the device memory the graphs hold.
    cuda_graphs: bool = False
    buckets: list[int] = field(default_factory=list)
    shapes: int = 0
    graph_memory_bytes: int = 0
    # The `[rows, tokens]` shapes built at warm-up (one row per request: `[1, tokens]`), and
    # those of them recorded as CUDA graphs: with graphs on, equal lists mean every shape was
    # captured; a CPU worker with `--cuda-graphs on` builds the shapes eagerly, captures none.
    graph_shapes: list[list[int]] = field(default_factory=list)
    captured_shapes: list[list[int]] = field(default_factory=list)
    # Whether the on-disk kernel caches (Triton, fla autotune) held entries at start-up:
    # "warm", "cold", or empty where no kernel is compiled (CPU).
    kernel_cache: str = ""
    # The fine-tuned variants served over this model (`--finetune`), each with its `name`,
    # LoRA `rank` and `scale`, `head` file, `checkpoint`, `adapted_modules` and `parameters`.
    finetunes: list[dict[str, Any]] = field(default_factory=list)
    # Every model this worker serves, by the name clients give it, with its content
    # fingerprint (hex): the base under its served name (`fingerprint` above), each variant
    # under its own name, its fingerprint covering the base's and the variant's adapter and
    # head files. The front serves a kept answer only while a ready worker serves the answer's
    # model with the answer's fingerprint, and sends a request only to a worker listing its
    # model. Empty from a worker that predates it (the front then knows the base only).
    models: dict[str, str] = field(default_factory=dict)

    def variant_fingerprints(self) -> dict[str, str]:
        """The fine-tuned variants this worker serves, by name, with their fingerprints (a
        variant listed in `finetunes` without one in `models` maps to "")."""
        return dict(self.weights.variants)

    @functools.cached_property
    def weights(self) -> Weights:
        """The one description of the weights this worker serves (`Weights`), read once from
        the frame: the base by `fingerprint`, each variant `finetunes` lists by its entry in
        `models` (never the base's entry, whatever the names)."""
        return Weights(self.fingerprint,
                       {str(item.get("name")): self.models.get(str(item.get("name")), "")
                        for item in self.finetunes})


@dataclass(frozen=True)
class Weights:
    """What one worker serves, by content fingerprint: the base (`base`, which answers to the
    served name, its aliases and the model id) and each fine-tuned variant by its name, in the
    worker's order. One description per worker: the worker builds it once its fingerprints are
    computed and sends it in `ready` (`fingerprint`, `finetunes`, `models`); the front reads it
    back (`ModelInfo.weights`) for `/health`, the variants `/v1/models` lists and admission
    routes by, the answer cache's binding and `Clef-Weights`; clef-batch for its output lines.
    A variant never has a base's name (the worker refuses such a checkpoint), so `models`,
    keyed by name, cannot hide the base."""

    base: str = ""
    variants: Mapping[str, str] = field(default_factory=dict)

    def of(self, model: str) -> str | None:
        """The fingerprint `model` ("" for the base, else a variant's name) is served with;
        None when this worker does not serve it."""
        return self.base if not model else self.variants.get(model)

    def by_name(self, base_name: str) -> dict[str, str]:
        """Every model by the name clients give it, the base under `base_name` (`ready`'s
        `models`, `/health`'s per-worker `models`)."""
        return {base_name: self.base, **self.variants}


def _shapes(value: Any) -> list[list[int]]:
    return [[int(rows), int(tokens)] for rows, tokens in value or ()]


@dataclass(frozen=True)
class SelfCheck:
    """The worker's start-up self-check (clef_worker.starting.self_check): a fixed set of requests
    answered through the layout it serves with and, one by one, through the plain eager path.

    `passed`: the layout it serves with agreed within the dtype's bound; `layout`: that layout
    (`packed-graphs`, `packed`, `per-group`, `padded-graphs`, `padded`, `one-at-a-time`);
    `checked`: requests compared; `max_abs_diff`: the largest probability difference seen on
    that layout; `fell_back_from`: the layouts that disagreed before it, in the order tried.

    Optional (absent from a worker that predates them, then the defaults): `mode` (the
    `--self-check` mode it ran under); `bound` (the probability bound it held to);
    `max_hidden_diff` (the largest per-token relative difference of the last hidden state,
    recorded beside the probabilities, not bounded); `ms` (what the check cost this start, or
    reading the kept verdict); `reused` (true: a passing verdict kept from an earlier start on
    the same weights, code, device, dtype and layout stands, nothing was run again); `probes`
    (each probe's own result: `name`, `passed`, `checked`, `max_abs_diff`, `max_hidden_diff`,
    `argmax_mismatches`, `groups` (the largest difference per forward), `error`, and any
    fields of its own).
    """

    passed: bool
    layout: str
    checked: int
    max_abs_diff: float
    fell_back_from: list[str] = field(default_factory=list)
    mode: str = ""
    bound: float = 0.0
    max_hidden_diff: float = 0.0
    ms: float = 0.0
    reused: bool = False
    probes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_message(cls, value: Any) -> SelfCheck:
        """Check and convert the `self_check` map of a `ready` frame (every field, its type)."""
        if (not isinstance(value, dict) or not set(value) >= _SELF_CHECK_FIELDS
                or not set(value) <= _SELF_CHECK_FIELDS | _SELF_CHECK_OPTIONAL):
            raise ValueError(f"self_check: expected a map of {sorted(_SELF_CHECK_FIELDS)} "
                             f"(and optionally {sorted(_SELF_CHECK_OPTIONAL)}), got {value!r}")
        passed, layout, checked = value["passed"], value["layout"], value["checked"]
        diff, fell_back = value["max_abs_diff"], value["fell_back_from"]
        optional = {**_SELF_CHECK_DEFAULTS, **{k: value[k] for k in _SELF_CHECK_OPTIONAL
                                                  if k in value}}
        if not (isinstance(passed, bool) and isinstance(layout, str)
                and isinstance(checked, int) and not isinstance(checked, bool) and checked >= 0
                and _non_negative(diff) and isinstance(fell_back, list)
                and all(isinstance(name, str) for name in fell_back)
                and isinstance(optional["mode"], str) and isinstance(optional["reused"], bool)
                and all(_non_negative(optional[k]) for k in ("bound", "max_hidden_diff", "ms"))
                and isinstance(optional["probes"], list)
                and all(isinstance(probe, dict) for probe in optional["probes"])):
            raise ValueError(f"self_check: a field has the wrong type or range: {value!r}")
        return cls(passed, layout, checked, float(diff), list(fell_back),
                   mode=optional["mode"], bound=float(optional["bound"]),
                   max_hidden_diff=float(optional["max_hidden_diff"]),
                   ms=float(optional["ms"]), reused=optional["reused"],
                   probes=[dict(probe) for probe in optional["probes"]])


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


_SELF_CHECK_FIELDS = frozenset(("passed", "layout", "checked", "max_abs_diff", "fell_back_from"))
_SELF_CHECK_DEFAULTS: dict[str, Any] = {"mode": "", "bound": 0.0, "max_hidden_diff": 0.0,
                                        "ms": 0.0, "reused": False, "probes": []}
_SELF_CHECK_OPTIONAL = frozenset(_SELF_CHECK_DEFAULTS)


def _count(value: object) -> bool:
    """Whether `value` is a whole number of at least zero (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# Why a worker's prefix cache is off when the operator chose it (the flag, or no bytes for it);
# any other `disabled_reason` is the start-up self-check's (its prefixed probe disagreed).
PREFIX_CACHE_OFF_BY_FLAG = "--prefix-cache off"
PREFIX_CACHE_NO_BYTES = "--prefix-cache-bytes 0"
# How the reason begins when the start-up probe could not check the cached path at all (the
# limits leave no room for a cached block): off by configuration, not a disagreement.
PREFIX_CACHE_UNCHECKED = "prefix cache unchecked"




# The start-up phases a worker reports (`StartupTimes.phases`), in the order they run; a worker
# reports the ones it ran (the release executor captures nothing and checks nothing).
STARTUP_PHASES = ("imports_s", "load_s", "capture_s", "warm_s", "fingerprint_s", "check_s")


@dataclass(frozen=True)
class StartupTimes:
    """Where a worker's start-up went (the `startup` map of `ready`, and so `/health`).

    `ready_s`: seconds from the worker's first import (its process start, less the interpreter's
    own start-up) to the `ready` frame. `phases`: seconds per phase of STARTUP_PHASES:
    `imports_s` the worker's own modules, up to reading the snapshot; `load_s` the snapshot
    read and the model built (torch's, transformers' and fla's imports happen here, fla's while
    the Gated DeltaNet path is bound);
    `capture_s` the graph shapes built (on a GPU: fla's kernels compiled and autotuned by the
    captures' warm runs); `warm_s` the rest of the warm-up (the first forwards, the prefix
    cache's kernels); `fingerprint_s` waiting for the weights' digest (hashed during the
    warm-up); `check_s` the self-check (near zero when a kept verdict is reused). Together
    they cover the start-up, so they add up to `ready_s` (a test holds them within 10 %).
    """

    ready_s: float
    phases: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_message(cls, value: Any) -> StartupTimes:
        """Check and convert the `startup` map of a `ready` frame."""
        if not isinstance(value, dict) or set(value) != {"ready_s", "phases"}:
            raise ValueError(f"startup: expected a map of ready_s and phases, got {value!r}")
        phases = value["phases"]
        if not (_non_negative(value["ready_s"]) and isinstance(phases, dict)
                and all(isinstance(name, str) and _non_negative(seconds)
                        for name, seconds in phases.items())):
            raise ValueError(f"startup: every figure must be seconds >= 0: {value!r}")
        return cls(float(value["ready_s"]), {str(k): float(v) for k, v in phases.items()})


@dataclass(frozen=True)
class PrefixCacheInfo:
    """The worker's prefix cache as it starts serving (the `prefix_cache` map of `ready`).

    `enabled`: requests may run only their uncached suffix; `capacity_bytes`: the cache's bound
    (`--prefix-cache-bytes` as resolved for the device); `block_tokens`: the tokens between two
    cached points; `disabled_reason`: why a worker that has a cache serves without it (`off` by
    flag, or the self-check's prefixed probe disagreed), empty while enabled.
    """

    enabled: bool
    capacity_bytes: int
    block_tokens: int
    disabled_reason: str = ""

    @property
    def turned_off(self) -> bool:
        """Off although the operator asked for it (the self-check turned it off): what the
        `ClefPrefixCacheTurnedOff` alert watches."""
        return (not self.enabled
                and self.disabled_reason not in (PREFIX_CACHE_OFF_BY_FLAG, PREFIX_CACHE_NO_BYTES)
                and not self.disabled_reason.startswith(PREFIX_CACHE_UNCHECKED))

    @classmethod
    def from_message(cls, value: Any) -> PrefixCacheInfo:
        """Check and convert the `prefix_cache` map of a `ready` frame (every field, its type)."""
        if not isinstance(value, dict) or set(value) != _PREFIX_CACHE_FIELDS:
            raise ValueError(f"prefix_cache: expected a map of {sorted(_PREFIX_CACHE_FIELDS)}, "
                             f"got {value!r}")
        enabled, capacity = value["enabled"], value["capacity_bytes"]
        block, reason = value["block_tokens"], value["disabled_reason"]
        if not (isinstance(enabled, bool) and _count(capacity) and _count(block)
                and isinstance(reason, str)):
            raise ValueError(f"prefix_cache: a field has the wrong type or range: {value!r}")
        return cls(enabled, capacity, block, reason)


_PREFIX_CACHE_FIELDS = frozenset(("enabled", "capacity_bytes", "block_tokens",
                                  "disabled_reason"))


@dataclass(frozen=True)
class PrefixStats:
    """The prefix cache's part in one `response` (its `prefix` map).

    `reused_tokens`: the leading tokens of this request read from the cache instead of computed;
    the rest are the worker's cache as the reply left it, cumulative since start: `bytes` and
    `entries` held, `hits` (lookups that reused at least one block), `lookups` and
    `tokens_reused`. The front shows the request's figure (Server-Timing) and the worker's
    (/health, metrics) without asking the worker.
    """

    reused_tokens: int
    bytes: int
    entries: int
    hits: int
    lookups: int
    tokens_reused: int

    @classmethod
    def from_message(cls, value: Any) -> PrefixStats:
        """Check and convert a response's `prefix` map: exactly its fields, each a count."""
        if not isinstance(value, dict) or set(value) != _PREFIX_STATS_FIELDS:
            raise ValueError(f"prefix: expected a map of {sorted(_PREFIX_STATS_FIELDS)}, "
                             f"got {value!r}")
        if not all(_count(value[name]) for name in _PREFIX_STATS_FIELDS):
            raise ValueError(f"prefix: every field must be a count >= 0: {value!r}")
        return cls(**value)


_PREFIX_STATS_FIELDS = frozenset(("reused_tokens", "bytes", "entries", "hits", "lookups",
                                  "tokens_reused"))


@dataclass(frozen=True)
class ReadyInfo(ModelInfo):
    """The whole `ready` frame: the model, plus the process that serves it."""

    pid: int = 0
    thread: str = ""
    warmup_ms: float = 0.0
    # The worker answers `ping` with `pong` between forwards. The front pings only a worker that
    # says so: an older worker (a --worker-command from before pings) exits on a frame it does
    # not know. Either way a worker silent with requests in flight is judged by --stall-timeout.
    pings: bool = False
    # The batch policy the worker resolved once from its flags (clef_worker.serving.policy) and
    # built its graph shapes for: the layout (packed / padded / per-group), the tokens one forward
    # may
    # hold, the requests one forward may hold (the front's in-flight cap for this worker), and
    # how long it waits for company. Zero / empty from a worker that does not report them (a
    # --worker-command of its own): the front then takes only what the protocol promises,
    # `requests_per_forward` and `tokens_per_forward` below.
    batch_layout: str = ""
    max_batch_tokens: int = 0
    max_sequences: int = 0
    batch_window_ms: float = 0.0
    # The start-up self-check's verdict; None when it was skipped (`--self-check off`, an
    # executor without layouts) or from a worker that predates it.
    self_check: SelfCheck | None = None
    # The prefix cache (clef_worker.serving.prefix.cache); None from a worker without one (the
    # release executor, a --worker-command of its own, a worker that predates it).
    prefix_cache: PrefixCacheInfo | None = None
    # Where the start-up's seconds went (StartupTimes); None from a worker that predates it.
    startup: StartupTimes | None = None

    @property
    def requests_per_forward(self) -> int:
        """The requests the front keeps in flight on this worker: what it reported, else one
        (a worker that says nothing about batching is only known to answer one at a time; the
        front never guesses the worker's own defaults)."""
        return self.max_sequences if self.max_sequences > 0 else 1

    def tokens_per_forward(self, max_length: int) -> int:
        """The tokens one of this worker's forwards holds: what it reported, else one
        request's most (`--max-length`, which the front and the worker share)."""
        return self.max_batch_tokens if self.max_batch_tokens > 0 else max_length

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ReadyInfo:
        """Check and convert a received `ready` frame; ValueError names what is malformed."""
        try:
            return cls(
                model=str(message["model"]),
                variant=str(message["variant"]),
                device=str(message["device"]),
                dtype=str(message["dtype"]),
                gdn_path=str(message["gdn_path"]),
                short_conv=str(message.get("short_conv", "")),
                versions={str(k): str(v) for k, v in (message.get("versions") or {}).items()},
                demo=bool(message.get("demo", False)),
                snapshot=str(message.get("snapshot", "")),
                fingerprint=str(message.get("fingerprint", "")),
                cuda_graphs=bool(message.get("cuda_graphs", False)),
                buckets=[int(length) for length in message.get("buckets") or ()],
                shapes=int(message.get("shapes", 0)),
                graph_memory_bytes=int(message.get("graph_memory_bytes", 0)),
                graph_shapes=_shapes(message.get("graph_shapes")),
                captured_shapes=_shapes(message.get("captured_shapes")),
                kernel_cache=str(message.get("kernel_cache", "")),
                finetunes=[dict(item) for item in message.get("finetunes") or ()],
                models={str(name): str(digest)
                        for name, digest in (message.get("models") or {}).items()},
                pid=int(message["pid"]),
                thread=str(message["thread"]),
                warmup_ms=float(message["warmup_ms"]),
                pings=bool(message.get("pings", False)),
                batch_layout=str(message.get("batch_layout", "")),
                max_batch_tokens=int(message.get("max_batch_tokens", 0)),
                max_sequences=int(message.get("max_sequences", 0)),
                batch_window_ms=float(message.get("batch_window_ms", 0.0)),
                self_check=(None if message.get("self_check") is None
                            else SelfCheck.from_message(message["self_check"])),
                prefix_cache=(None if message.get("prefix_cache") is None
                              else PrefixCacheInfo.from_message(message["prefix_cache"])),
                startup=(None if message.get("startup") is None
                         else StartupTimes.from_message(message["startup"])),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed ready frame: {exc!r}") from None


@dataclass(frozen=True)
class Fatal:
    """The worker cannot start; `reason` is shown to the operator verbatim."""

    reason: str


@dataclass(frozen=True)
class Request:
    """One admitted `/v1/systemone` body, as the client sent it, and its three ids."""

    id: int
    body: bytes
    request_id: str = ""
    trace_id: str = ""

    def message(self) -> dict[str, Any]:
        return request(self.id, self.body, self.request_id, self.trace_id)


@dataclass(frozen=True)
class WorkerReply:
    """The worker's one reply to a request: a `response` (body set) or an `error` (detail set).

    `id` is the request's frame id (0 where a reply is built outside the channel, in tests).
    """

    status: int
    body: bytes | None
    detail: str | None
    worker_ms: float | None
    input_tokens: int = 0  # the encoded sequence's length (responses only)
    truncated_tokens: int = 0  # state tokens dropped to fit --max-length (responses only)
    batch_size: int = 1  # requests in the worker forward that answered it (responses only)
    # The worker's stage durations (encode_ms, forward_ms, head_ms), when it reports them; the
    # trace spans' only source (clef_frontend.otel), so a malformed one is dropped, not fatal.
    stages: dict[str, float] | None = None
    id: int = 0
    # The prefix cache's part (responses only): None from a worker without a cache, or when it
    # sent none.
    prefix: PrefixStats | None = None
    # The content fingerprint of the model that scored it (`ReadyInfo.models`; responses only,
    # "" from a worker that predates it): the kept answer is bound to it.
    weights: str = ""


@dataclass(frozen=True)
class Ping:
    seq: int


@dataclass(frozen=True)
class Pong:
    seq: int


@dataclass(frozen=True)
class Shutdown:
    """Finish the requests already read and exit 0."""


FromWorker = ReadyInfo | Fatal | WorkerReply | Pong
FromFront = Request | Ping | Shutdown


def _int(message: dict[str, Any], key: str, *, absent: int | None = None, least: int = 0) -> int:
    """A whole-number field of at least `least`; `absent` stands in for a missing one (None:
    it is required)."""
    value = message.get(key, absent)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ProtocolError(f"malformed {message.get('kind')} frame ({key} {value!r})")
    return value


def _text(message: dict[str, Any], key: str) -> str:
    """An optional string field ("" when absent)."""
    value = message.get(key, "")
    if not isinstance(value, str):
        raise ProtocolError(f"malformed {message.get('kind')} frame ({key} {value!r})")
    return value


def _stages(value: object) -> dict[str, float] | None:
    """A response's `stages`: names to non-negative milliseconds, or None."""
    if not isinstance(value, dict):
        return None
    stages = {key: float(ms) for key, ms in value.items() if isinstance(key, str)
              and isinstance(ms, int | float) and not isinstance(ms, bool)
              and 0 <= ms < float("inf")}
    return stages or None


def _prefix(message: dict[str, Any]) -> PrefixStats | None:
    """A response's `prefix` map, or None when absent; a malformed one breaks the contract (its
    counts feed /health and the metrics, which must never show a guessed figure)."""
    value = message.get("prefix")
    if value is None:
        return None
    try:
        return PrefixStats.from_message(value)
    except ValueError as exc:
        raise ProtocolError(f"malformed response frame ({exc})") from None


def _reply(message: dict[str, Any]) -> WorkerReply:
    """A `response` or `error` frame; a missing status is malformed too: guessing 200 for it
    would forward whatever body came with a broken frame as a success."""
    kind = message["kind"]
    frame_id = _int(message, "id")
    status = message.get("status")
    worker_ms = message.get("worker_ms")
    if not isinstance(worker_ms, int | float) or isinstance(worker_ms, bool):
        worker_ms = None
    if kind == RESPONSE:
        body = message.get("body")
        if not isinstance(body, bytes) or not isinstance(status, int) or not 200 <= status < 300:
            raise ProtocolError(f"malformed response frame (status {status!r})")
        return WorkerReply(status, body, None, worker_ms,
                           input_tokens=_int(message, "input_tokens", absent=0),
                           truncated_tokens=_int(message, "truncated_tokens", absent=0),
                           batch_size=_int(message, "batch_size", absent=1, least=1),
                           stages=_stages(message.get("stages")), id=frame_id,
                           prefix=_prefix(message),
                           weights=_text(message, "weights"))
    detail = message.get("detail")
    if not isinstance(status, int) or not 400 <= status < 600 or not isinstance(detail, str):
        raise ProtocolError(f"malformed error frame (status {status!r})")
    return WorkerReply(status, None, detail, worker_ms, id=frame_id)


def from_worker(message: dict[str, Any]) -> FromWorker:
    """A frame the worker sent, as its value; ProtocolError if it is not one the worker may
    send or a field is malformed."""
    kind = message.get("kind")
    if kind in (RESPONSE, ERROR):
        return _reply(message)
    if kind == PONG:
        return Pong(_int(message, "seq"))
    if kind == READY:
        return ReadyInfo.from_message(message)
    if kind == FATAL:
        return Fatal(str(message.get("reason", "(no reason)")))
    raise ProtocolError(f"unexpected {kind!r} frame from the worker")


def from_front(message: dict[str, Any]) -> FromFront:
    """A frame the front sent, as its value; ProtocolError if it is not one the front may send
    or a field is malformed (a request's body is always bytes)."""
    kind = message.get("kind")
    if kind == REQUEST:
        body = message.get("body")
        if not isinstance(body, bytes):
            raise ProtocolError(f"malformed request frame (body {type(body).__name__})")
        return Request(_int(message, "id"), body, _text(message, "request_id"),
                       _text(message, "trace_id"))
    if kind == PING:
        return Ping(_int(message, "seq"))
    if kind == SHUTDOWN:
        return Shutdown()
    raise ProtocolError(f"unexpected {kind!r} frame from the front")


def ready(info: ReadyInfo) -> dict[str, Any]:
    """The worker is loaded and its warm-up forward has returned: the front may bind its port."""
    return {"kind": READY, **asdict(info)}


def fatal(reason: str) -> dict[str, Any]:
    """The worker cannot start; `reason` is shown to the operator verbatim."""
    return {"kind": FATAL, "reason": reason}


def request(frame_id: int, body: bytes, request_id: str = "",
            trace_id: str = "") -> dict[str, Any]:
    """One admitted body and its ids (see the module docstring); the string ids are sent only
    when known, so an untraced request's frame carries no trace id (nor the access log's `-`)."""
    message: dict[str, Any] = {"kind": REQUEST, "id": frame_id, "body": body}
    if request_id:
        message["request_id"] = request_id
    if is_trace_id(trace_id):
        message["trace_id"] = trace_id
    return message


def response(
    request_id: int,
    body: bytes,
    worker_ms: float,
    status: int = 200,
    *,
    input_tokens: int = 0,
    truncated_tokens: int = 0,
    batch_size: int = 1,
    stages: dict[str, float] | None = None,
    prefix: PrefixStats | None = None,
    weights: str = "",
) -> dict[str, Any]:
    """A successful answer: `body` is the final JSON, forwarded to the client unchanged.

    `input_tokens` is the length of the encoded sequence and `truncated_tokens` how many state
    tokens were dropped to fit `--max-length` (0 where the executor cannot tell), so the front can
    count tokens and say when a state was cut without parsing the body. `batch_size` is how many
    requests the forward that answered this one held (1 when it ran alone), so operators see
    whether batching happens. `worker_ms` is the worker's time for this request, from reading its
    frame to having its reply ready (waiting for company, earlier forwards of the same read, its
    own forward): the one meaning every executor's replies share.

    `stages` (optional, absent when not given) is the worker's part for tracing spans:
    `encode_ms` (this request's parse, validation and encoding), `forward_ms` and `head_ms`
    (the forward that answered it, shared by every request in it).

    `prefix` (optional, absent when not given) is the prefix cache's part: the tokens this
    request reused and the worker's cache figures (`PrefixStats`).

    `weights` (absent when empty) is the fingerprint of the model that scored it, as `ready`'s
    `models` lists it: the front binds the answer it keeps to those weights and names them in
    the response's `Clef-Weights` header.
    """
    frame: dict[str, Any] = {"kind": RESPONSE, "id": request_id, "status": status, "body": body,
             "worker_ms": worker_ms, "input_tokens": input_tokens,
             "truncated_tokens": truncated_tokens, "batch_size": batch_size}
    if stages:
        frame["stages"] = dict(stages)
    if prefix is not None:
        frame["prefix"] = asdict(prefix)
    if weights:
        frame["weights"] = weights
    return frame


def error(request_id: int, status: int, detail: str, worker_ms: float) -> dict[str, Any]:
    """A refused (422) or failed (500) request; the front turns `detail` into `{"detail": ...}`."""
    return {"kind": ERROR, "id": request_id, "status": status, "detail": detail,
            "worker_ms": worker_ms}


def shutdown() -> dict[str, Any]:
    """Finish the current request (if any) and exit 0."""
    return {"kind": SHUTDOWN}


def ping(seq: int) -> dict[str, Any]:
    """Ask the worker whether it is alive; it answers `pong` with the same `seq` between forwards.

    A worker busy in a long forward answers once the forward returns, so the front judges a
    stall by "no pong and no completed forward for `--stall-timeout`", never by one late pong.
    """
    return {"kind": PING, "seq": seq}


def pong(seq: int) -> dict[str, Any]:
    """The worker's answer to `ping(seq)`."""
    return {"kind": PONG, "seq": seq}

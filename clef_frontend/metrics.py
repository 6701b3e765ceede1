"""Prometheus metrics of the front: what an operator alerts on, in the text exposition format.

Everything is measured where it already happens and recorded here through a few calls
(`request_done`, `worker_failed`); gauges that mirror live state (queue depth, in flight, worker
ready, model info) are read from that state at scrape time, so they can never drift from what
`/health` says. A registry per server (not prometheus_client's global one) keeps servers in one
process, such as tests, apart.

Exposed on `GET /metrics` of the public port, or, with `--metrics-port`, only on a separate
port served by a small HTTP server on its own thread (exposition.py, which also writes the
text format cheaply: an endpoint picker scrapes every 50 ms), so metrics can stay off the
public side. Names follow the Prometheus conventions: a `clef_` prefix, base units (`_seconds`),
`_total` for counters. The reference table is in docs/operations.md.
"""

from __future__ import annotations

import functools
import logging
import platform
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from clef_api import responses
from clef_api.responses import Reply
from clef_dispatch import RESTART_REASONS
from clef_frontend import exposition
from clef_frontend.logs import lost_writes
from clef_frontend.loop_metrics import CounterChild, LoopCounter, LoopHistogram
from clef_frontend.priority import CLASSES, INTERACTIVE
from clef_protocol.messages import ReadyInfo, WorkerReply

log = logging.getLogger("clef_frontend.metrics")

# Seconds: from a millisecond /health-style answer to the request timeout's order of magnitude.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
# Input tokens per request: powers of two up to above the largest token budget.
TOKEN_BUCKETS = tuple(float(2**n) for n in range(6, 17))
BATCH_BUCKETS = tuple(float(2**n) for n in range(7))  # 1 .. 64 requests per forward
_LABEL_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


@dataclass(frozen=True)
class LiveState:
    """Where the gauges read live state at scrape time (wired by the server)."""

    queue_depth: Callable[[str], int]  # waiting requests of one priority class
    in_flight: Callable[[], int]
    queue_capacity: int
    worker_ready: Callable[[], bool]
    worker_info: Callable[[], ReadyInfo | None]
    # The endpoint picker's three gauges (load.py): all classes waiting, and the token budget
    # in use (0-1). The third, requests running, is `in_flight`.
    queued: Callable[[], int] = lambda: 0
    cache_bytes: Callable[[], int] = lambda: 0  # what the kept answers cost (answer_cache.py)
    cache_joiners: Callable[[], int] = lambda: 0  # requests waiting on another's forward
    token_usage: Callable[[], float] = lambda: 0.0
    # Each ready worker's prefix cache by slot name (Dispatcher.prefix_caches).
    prefix_caches: Callable[[], list[tuple[str, dict[str, Any]]]] = lambda: []


class Metrics:
    """The front's metrics and their exposition."""

    def __init__(self, live: LiveState, *, version: str, separate_port: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._separate_port = separate_port
        self._server: Any = None
        r = self.registry
        # Recorded per request: loop_metrics' cheap families (same exposition).
        self.requests = LoopCounter(
            "clef_http_requests", "HTTP requests answered, by route, status and key name "
            "(`-`: no key).", ["route", "status", "key"])
        self._request_counters: dict[tuple[str, int, str], CounterChild] = {}
        self.queue_seconds = LoopHistogram(
            "clef_request_queue_seconds",
            "Time scoring requests waited for the worker, by priority class.", ["class"],
            buckets=LATENCY_BUCKETS)
        self.worker_seconds = LoopHistogram(
            "clef_request_worker_seconds",
            "The worker's own time per scoring request (worker_ms of its reply frame).",
            buckets=LATENCY_BUCKETS)
        self.duration_seconds = LoopHistogram(
            "clef_request_duration_seconds",
            "Scoring requests from the end of their head to their answer, every status.",
            buckets=LATENCY_BUCKETS)
        self.input_tokens = LoopHistogram(
            "clef_request_input_tokens", "Tokens the model read per answered scoring request.",
            buckets=TOKEN_BUCKETS)
        self.batch_size = LoopHistogram(
            "clef_request_batch_size",
            "Requests in the worker forward that answered each answered scoring request "
            "(1: it ran alone).", buckets=BATCH_BUCKETS)
        for family in (self.requests, self.queue_seconds, self.worker_seconds,
                       self.duration_seconds, self.input_tokens, self.batch_size):
            r.register(family)
        self.truncated = Counter(
            "clef_states_truncated", "Answered requests whose state was cut to fit the budget.",
            registry=r)
        self.truncated_tokens = Counter(
            "clef_truncated_tokens",
            "State tokens dropped to fit the token budget (the responses' truncated_tokens).",
            registry=r)
        self.restarts = Counter(
            "clef_worker_restarts", "Warm workers lost and replaced, by reason.", ["reason"],
            registry=r)
        for reason in RESTART_REASONS:
            self.restarts.labels(reason=reason)
        self.suspects = Counter(
            "clef_worker_suspects", "Times a warm worker became suspect: its pong or reply "
            "overdue by its margin (clef_dispatch/liveness.py); it got no new work meanwhile.",
            registry=r)
        depth = Gauge("clef_queue_depth", "Requests waiting for the worker, by priority class.",
                      ["class"], registry=r)
        self._queue_by_class = {name: self.queue_seconds.labels(name) for name in CLASSES}
        for name in CLASSES:
            depth.labels(name).set_function(functools.partial(_as_float, live.queue_depth, name))
        Gauge("clef_queue_capacity", "Requests that may wait (--queue-size).",
              registry=r).set(live.queue_capacity)
        # The endpoint picker's three gauges are also the whole of LOAD_PATH on the metrics
        # port (`load_registry`): a scrape every 50 ms needs only them.
        self.load_registry = CollectorRegistry(auto_describe=True)
        running = Gauge("clef_requests_in_flight",
                        "Requests the workers are answering now, all workers together.",
                        registry=None)
        running.set_function(lambda: float(live.in_flight()))
        Gauge("clef_worker_ready", "1 while a warm worker accepts requests, else 0.",
              registry=r).set_function(lambda: 1.0 if live.worker_ready() else 0.0)
        # For an endpoint picker (docs/operations.md, "Behind the inference gateway"): one
        # series each, no labels, so a picker's metric spec names exactly one.
        queued = Gauge("clef_requests_queued",
                       "Requests waiting for a worker, every class together.", registry=None)
        queued.set_function(lambda: float(live.queued()))
        usage = Gauge("clef_token_budget_usage_ratio",
                      "Estimated tokens of the requests waiting and in flight over the token "
                      "budget (--max-batch-tokens) of the ready workers, capped at 1; 1 with no "
                      "worker ready.", registry=None)
        usage.set_function(live.token_usage)
        for gauge in (queued, running, usage):
            r.register(gauge)
            self.load_registry.register(gauge)
        r.register(_InfoCollector(version, live.worker_info))
        r.register(_SelfCheckCollector(live.worker_info))
        r.register(_LostLogCollector())
        r.register(_PrefixCacheCollector(live.prefix_caches))
        self._shared_traffic_metrics()
        Gauge("clef_answer_cache_bytes", "Bytes the answer cache's kept answers cost in memory "
              "(each entry measured: its body, key, reply objects and table slot), bounded by "
              "--answer-cache-bytes.",
              registry=r).set_function(lambda: float(live.cache_bytes()))
        Gauge("clef_answer_cache_joiners", "Requests waiting now for an identical request's "
              "forward (joined it, not answered yet).",
              registry=r).set_function(lambda: float(live.cache_joiners()))

    # -- shared traffic: quotas, answer cache, deadlines, resends -----------------------------

    def _shared_traffic_metrics(self) -> None:
        """The metrics of keys' quotas, the answer cache, deadlines and resent requests."""
        r = self.registry
        self.quota_refusals = Counter(
            "clef_quota_refusals", "Requests refused 429 because their key was over its rate, "
            "by key name.", ["key"], registry=r)
        self.answer_cache = LoopCounter(
            "clef_answer_cache", "Answer cache lookups of scoring requests, by how the answer "
            "came, counted once it has: `hit` (from the cache), `coalesced` (an identical "
            "request's forward, waited on), `miss` (its own forward, a joiner admitted on its "
            "own when the forward it shared was not answered 200 included).",
            ["result"])
        r.register(self.answer_cache)
        self._cache_results = {result: self.answer_cache.labels(result)
                               for result in ("hit", "coalesced", "miss")}
        self.deadline_expired = Counter(
            "clef_deadline_expired", "Requests answered 504 because their deadline passed while "
            "they waited (for a worker, or for a shared forward), by priority class.", ["class"],
            registry=r)
        self.model_requests = Counter(
            "clef_model_requests", "Scoring requests by the model their body named (only with "
            "fine-tuned variants served, docs/finetune.md: a variant or a served name; unknown "
            "names are refused before this count) and status.", ["model", "status"],
            registry=r)
        self.resent = Counter(
            "clef_requests_resent", "Requests sent again, counted when sent: by why their "
            "worker was lost with them in flight (`crash`, `hung`, `protocol`, `stalled`), or "
            "`suspect`, a copy sent to another worker while a suspect one held them. A copy "
            "withdrawn or taken back unsent, or a lost request answered before it went again, "
            "is not counted.", ["reason"], registry=r)
        for name in CLASSES:
            self.deadline_expired.labels(name)
        for reason in RESEND_REASONS:
            self.resent.labels(reason=reason)

    def quota_refused(self, key: str) -> None:
        self.quota_refusals.labels(key=key).inc()

    def answer_cache_lookup(self, result: str) -> None:
        self._cache_results[result].inc()

    def expired(self, priority: str) -> None:
        self.deadline_expired.labels(priority).inc()

    def request_resent(self, reason: str) -> None:
        self.resent.labels(reason=reason).inc()

    # -- recording --------------------------------------------------------------------------

    def model_request(self, model: str, status: int) -> None:
        """One request whose body named `model`, a name the catalogue knows (a bounded set)."""
        self.model_requests.labels(model, str(status)).inc()

    def request_done(
        self,
        *,
        route: str,
        status: int,
        duration_s: float,
        scoring: bool = False,
        queue_ms: float | None = None,
        worker_ms: float | None = None,
        worker_reply: WorkerReply | None = None,
        key: str = "-",
        priority: str = INTERACTIVE,
    ) -> None:
        """One answered request; `scoring` (the route's `Route.is_scoring`) puts it in the
        latency, token and batch histograms, whichever route it came by.

        `key` is the key's name (never the key), `-` without one; `priority` its class.
        """
        counter = self._request_counters.get((route, status, key))
        if counter is None:  # labels() costs a lock and a dict build per call: look it up once
            counter = self.requests.labels(route, str(status), key)
            self._request_counters[(route, status, key)] = counter
        counter.inc()
        if not scoring:
            return
        self.duration_seconds.observe(duration_s)
        if queue_ms is not None:
            self._queue_by_class[priority].observe(queue_ms / 1000.0)
        if worker_ms is not None:
            self.worker_seconds.observe(worker_ms / 1000.0)
        if worker_reply is None or worker_reply.body is None:
            return  # token counts come with answers only, not with refusals
        self.input_tokens.observe(worker_reply.input_tokens)
        self.batch_size.observe(worker_reply.batch_size)
        if worker_reply.truncated_tokens:
            self.truncated.inc()
            self.truncated_tokens.inc(worker_reply.truncated_tokens)

    def worker_suspect(self) -> None:
        """A worker became suspect (clef_dispatch/liveness.py)."""
        self.suspects.inc()

    def worker_failed(self, reason: str) -> None:
        """A warm worker was lost (see worker_channel.failure_reason for the reasons)."""
        self.restarts.labels(reason=reason).inc()

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> bytes:
        return exposition.render(self.registry)

    def public_reply(self) -> Reply:
        """`GET /metrics` on the public port: 404 when metrics live on their own port."""
        if self._separate_port:
            return responses.error(404, "unknown route")
        return Reply(200, self.render(), content_type=CONTENT_TYPE_LATEST)

    def serve(self, host: str, port: int) -> int:
        """Serve the metrics on their own port (LOAD_PATH: the picker's three gauges; any other
        path: everything); the port actually bound."""
        self._server = exposition.serve(self.registry, host, port,
                                        {LOAD_PATH: self.load_registry})
        bound: int = self._server.server_address[1]
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# On the metrics port, the endpoint picker's three gauges alone (docs/operations.md, "Behind the
# inference gateway"): a few hundred bytes instead of every metric, for a scrape every 50 ms.
LOAD_PATH = "/metrics/load"

# Why a request was sent again: `WorkerLost.reason` (worker_channel.py's failure kinds), or
# `suspect` (its worker was suspect, clef_dispatch/liveness.py; the first answer wins).
RESEND_REASONS = ("crash", "hung", "protocol", "stalled", "suspect")


def _as_float(read: Callable[[str], int], name: str) -> float:
    return float(read(name))


def route_label(target: bytes, known: bool) -> str:
    """The `route` label: the path for known routes, `unknown` for everything else (client
    paths never become labels, which would let clients grow the series without bound)."""
    return target.decode("ascii", "replace") if known else "unknown"


class _InfoCollector(Collector):
    """`clef_build_info` and `clef_model_info` (the warm worker's model), built at scrape time."""

    def __init__(self, version: str, worker_info: Callable[[], ReadyInfo | None]) -> None:
        self._version = version
        self._worker_info = worker_info

    def collect(self) -> Iterator[InfoMetricFamily]:
        yield InfoMetricFamily("clef_build", "clef-serve build.", value={
            "version": self._version, "python": platform.python_version()})
        info = self._worker_info()
        if info is None:
            return
        labels = {"model": info.model, "variant": info.variant, "device": info.device,
                  "dtype": info.dtype, "gdn_path": info.gdn_path, "demo": str(info.demo).lower()}
        for package, version in sorted(info.versions.items()):
            labels[f"version_{_LABEL_UNSAFE.sub('_', package)}"] = version
        yield InfoMetricFamily("clef_model", "The warm worker's model and how it runs.",
                               value=labels)


class _LostLogCollector(Collector):
    """`clef_log_writes_lost_total`: log writes stderr refused (logs.BatchingHandler.flush),
    read at scrape time from the handler that counts them."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "clef_log_writes_lost", "Writes of log lines that stderr refused (its reader gone, "
            "a full disk): those lines are lost; the server serves on.", value=lost_writes())


# The prefix cache's series, per worker: (name, kind, help, field of Dispatcher.prefix_caches).
PREFIX_CACHE_SERIES = (
    ("clef_prefix_cache_enabled", "gauge", "1 while the worker serves with its prefix cache on "
     "(0: off by flag, or disabled by its start-up self-check: /health says why).", "enabled"),
    ("clef_prefix_cache_capacity_bytes", "gauge", "The bound of the worker's prefix cache "
     "(--prefix-cache-bytes as resolved for its device).", "capacity_bytes"),
    ("clef_prefix_cache_bytes", "gauge", "Bytes the worker's prefix cache holds (model states, "
     "K/V and the head's memory of cached prompt prefixes).", "bytes"),
    ("clef_prefix_cache_entries", "gauge", "Cached prefix points the worker holds.", "entries"),
    ("clef_prefix_cache_hits", "counter", "Lookups that reused at least one cached block, since "
     "the worker started.", "hits"),
    ("clef_prefix_cache_lookups", "counter", "Prefix cache lookups (requests looked up), since "
     "the worker started.", "lookups"),
    ("clef_prefix_cache_tokens_reused", "counter", "Prompt tokens read from the prefix cache "
     "instead of computed, since the worker started.", "tokens_reused"),
    ("clef_prefix_cache_turned_off", "gauge", "1 when the worker's start-up self-check turned "
     "its prefix cache off (the prefixed probe disagreed with the eager answers; /health says "
     "by how much), 0 otherwise (on, or off by flag).", "turned_off"),
)


class _PrefixCacheCollector(Collector):
    """The ready workers' prefix caches (their `ready` and their latest reply's figures),
    labelled by worker slot, read at scrape time; nothing for workers without one. The
    counters restart from 0 with a replaced worker, which Prometheus' rate() reads as a
    reset."""

    def __init__(self, caches: Callable[[], list[tuple[str, dict[str, Any]]]]) -> None:
        self._caches = caches

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        caches = self._caches()
        if not caches:
            return
        for name, kind, text, field in PREFIX_CACHE_SERIES:
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, text, labels=["worker"])
            else:
                family = GaugeMetricFamily(name, text, labels=["worker"])
            for worker, cache in caches:
                family.add_metric([worker], float(cache[field]))
            yield family


class _SelfCheckCollector(Collector):
    """The warm worker's start-up self-check (clef_worker.starting.self_check, its `ready` frame's
    `self_check`), labelled by the layout it serves with; nothing when it was skipped."""

    def __init__(self, worker_info: Callable[[], ReadyInfo | None]) -> None:
        self._worker_info = worker_info

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = self._worker_info()
        verdict = info.self_check if info is not None else None
        if verdict is None:
            return
        for name, text, value in (
                ("passed", "1 when the layout the worker serves with agreed with the eager "
                 "one-by-one answers at start-up, else 0.", float(verdict.passed)),
                ("max_abs_diff", "The largest probability difference the start-up self-check "
                 "saw on the layout the worker serves with.", verdict.max_abs_diff),
                ("fallbacks", "Layouts the start-up self-check fell back from (0: the default "
                 "layout agreed).", float(len(verdict.fell_back_from))),
                ("reused", "1 when the worker kept the passing verdict of an earlier start on "
                 "the same weights, code, device, dtype and layout instead of checking again.",
                 float(verdict.reused))):
            family = GaugeMetricFamily(f"clef_worker_self_check_{name}", text,
                                       labels=["layout"])
            family.add_metric([verdict.layout], value)
            yield family

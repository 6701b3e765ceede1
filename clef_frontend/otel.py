"""OpenTelemetry traces: one server span per request, its queue wait and the worker's part.

Off unless the standard variables ask for it, and then the SDK is imported, never before: the
base install has no OpenTelemetry (the `otel` extra brings it), and a server that does not
trace pays one `None` check per request. Tracing is on when `OTEL_TRACES_EXPORTER` names
`otlp`, or, with that variable unset, when an OTLP endpoint is set
(`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `OTEL_TRACES_EXPORTER=
none` or `OTEL_SDK_DISABLED=true` keep it off. The protocol is
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or `OTEL_EXPORTER_OTLP_PROTOCOL`: `http/protobuf` (the
specification's default) or `grpc`. Everything else is the SDK's own reading of the
environment: the exporters' endpoint, headers, timeout, compression and certificates, the
batch processor's `OTEL_BSP_*`, the sampler's `OTEL_TRACES_SAMPLER[_ARG]` (parent-based by
default, so a caller's sampling decision holds), and the resource's `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` (service.name defaults to `clef-serve`).

Spans are made after the fact from times the front measures anyway (the request's start, the
ticket's queue times, the reply's arrival and the worker's own durations), so tracing adds no
clock reads or awaits to the request path. The worker's part: with the reply's `stages`
(`encode_ms`, `forward_ms`, `head_ms`) one span each, laid end to end so the last ends when
the reply arrived; without them one `worker` span of `worker_ms`. A batched forward's times are
the whole batch's, shared by every request in it (attribute `clef.batch_size`). An answer shared
through the answer cache has a `cache` span where a worker's answer has those: from the lookup
to the answer (at once for a kept answer, `hit`; the shared forward's remaining time for one
that joined it, `coalesced`); the server span's `clef.cache` says which (`miss` for a request
that went to a worker itself).

Spans go through a `BatchSpanProcessor` (export never runs on the event loop); `shutdown`
flushes what is pending when the server exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clef_frontend.tracing import TraceContext

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from clef_dispatch import TicketView

log = logging.getLogger("clef_frontend.otel")

SERVICE_NAME = "clef-serve"
PROTOCOLS = ("http/protobuf", "grpc")
STAGES = (("encode", "encode_ms"), ("forward", "forward_ms"), ("head", "head_ms"))
# How long the exit waits for the last spans to leave.
FLUSH_TIMEOUT_MS = 5000


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for something this server cannot do (named in the message)."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for trace export (see the module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip())


def protocol_of(environ: Mapping[str, str]) -> str:
    """The OTLP protocol asked for; TracingConfigError for one the server does not speak."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or PROTOCOLS[0])
    if protocol not in PROTOCOLS:
        raise TracingConfigError(
            f"OTLP protocol {protocol!r} is not supported: use one of {', '.join(PROTOCOLS)}")
    return protocol


def _check_exporters(environ: Mapping[str, str]) -> None:
    exporters = [name.strip().lower()
                 for name in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    unsupported = [name for name in exporters if name not in ("otlp", "")]
    if unsupported:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER {', '.join(unsupported)} is not supported: use otlp or none")


@dataclass(frozen=True)
class Finished:
    """What the front knows about a request once it is answered (monotonic seconds)."""

    status: int
    route: str
    # Its last wait for a worker (`TicketView.last_wait`): queue time per send, as the access line,
    # Server-Timing and the histogram count it, never time on a worker lost or suspect.
    queued_at: float | None = None  # that wait began (None: it never reached the queue)
    sent_at: float | None = None  # ...and ended, handed to a worker (None: no send ended it)
    answered_at: float | None = None  # the worker's reply arrived
    worker_ms: float | None = None
    stages: Mapping[str, float] | None = None
    batch_size: int | None = None
    cache: str | None = None  # the answer cache's hit, coalesced or miss (None: not looked up)
    shared_at: float | None = None  # when the cache was consulted
    tenant: str | None = None  # the inference gateway's fairness id (gateway.py), if any
    reused_tokens: int | None = None  # given by the worker's prefix cache (None: not looked up)


class RequestSpan:
    """One request's server span, from `Tracing.begin` to `finish`."""

    def __init__(self, tracing: Tracing, span: Span, method: str) -> None:
        self._tracing = tracing
        self._span = span
        # Wall clock (for the exporter) anchored to the monotonic clock the front measures in.
        self._wall_ns = time.time_ns()
        self._mono = time.monotonic()
        self._method = method
        self.trace_id = format(span.get_span_context().trace_id, "032x")

    def _ns(self, monotonic: float) -> int:
        return self._wall_ns + int((monotonic - self._mono) * 1e9)

    def finish(self, done: Finished) -> None:
        """End the server span and add its children (queue, worker stages) under it."""
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        span = self._span
        end_ns = time.time_ns()
        if not span.is_recording():  # sampled out: nothing to record, nothing to export
            span.end(end_ns)
            return
        if done.route not in ("-", "unknown"):
            span.update_name(f"{self._method} {done.route}")
            span.set_attribute("http.route", done.route)
        span.set_attribute("http.response.status_code", done.status)
        if done.tenant is not None:
            span.set_attribute("clef.tenant", done.tenant)
        if done.status >= 500:  # a server span's error is the server's fault only
            span.set_status(Status(StatusCode.ERROR))
        if done.cache is not None:
            span.set_attribute("clef.cache", done.cache)
        if done.reused_tokens is not None:
            span.set_attribute("clef.prefix.reused_tokens", done.reused_tokens)
        tracer = self._tracing.tracer
        inside = set_span_in_context(span)
        if done.cache is not None and done.queued_at is None and done.shared_at is not None:
            cache_end = self._ns(done.answered_at) if done.answered_at is not None else end_ns
            tracer.start_span("cache", context=inside, start_time=self._ns(done.shared_at),
                              attributes={"clef.cache": done.cache}).end(cache_end)
        if done.queued_at is not None:
            queue_end = done.sent_at if done.sent_at is not None else done.answered_at
            queue_end_ns = self._ns(queue_end) if queue_end is not None else end_ns
            tracer.start_span("queue", context=inside,
                              start_time=self._ns(done.queued_at)).end(queue_end_ns)
        if done.answered_at is not None:
            attributes: dict[str, Any] = {}
            if done.batch_size is not None:
                attributes["clef.batch_size"] = done.batch_size
            cursor = self._ns(done.answered_at)
            stages = _valid_stages(done.stages)
            if stages is not None:
                for name, duration_ms in reversed(stages):
                    start = cursor - int(duration_ms * 1e6)
                    tracer.start_span(name, context=inside, start_time=start,
                                      attributes=attributes).end(cursor)
                    cursor = start
            elif done.worker_ms is not None and 0 <= done.worker_ms < float("inf"):
                tracer.start_span("worker", context=inside,
                                  start_time=cursor - int(done.worker_ms * 1e6),
                                  attributes=attributes).end(cursor)
        span.end(end_ns)


def _valid_stages(stages: Mapping[str, float] | None) -> list[tuple[str, float]] | None:
    """The worker's stage durations in order, or None unless all three are usable numbers."""
    if not stages:
        return None
    found = []
    for name, key in STAGES:
        value = stages.get(key)
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not 0 <= value < float("inf")):
            return None
        found.append((name, float(value)))
    return found


class Tracing:
    """The SDK's tracer provider with its OTLP exporter; one per server process."""

    def __init__(self, provider: TracerProvider, tracer: Tracer) -> None:
        self.provider = provider
        self.tracer = tracer

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Tracing:
        """Build the provider the OTEL_* variables describe (the SDK imported here, only)."""
        _check_exporters(environ)
        protocol = protocol_of(environ)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
                exporter: SpanExporter = GrpcExporter()
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter as HttpExporter,
                )
                exporter = HttpExporter()
        except ImportError as exc:
            raise TracingConfigError(
                f"OTEL_* variables ask for traces but the OpenTelemetry SDK is missing ({exc}); "
                "install clef-serve[otel]") from None
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        # Our shutdown (bounded) flushes at exit, not the SDK's unbounded atexit hook.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        from clef_frontend.version import version

        return cls(provider, provider.get_tracer("clef_frontend", version()))

    def begin(self, context: TraceContext, method: bytes, target: bytes, request_id: str,
              started: float) -> RequestSpan:
        """Start the server span of a request whose head arrived at `started` (monotonic)."""
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
        from opentelemetry.trace.span import TraceState

        parent = None
        if context.parent is not None:
            state = (TraceState.from_header([context.tracestate])
                     if context.tracestate is not None else None)
            remote = SpanContext(
                trace_id=int(context.parent.trace_id, 16),
                span_id=int(context.parent.parent_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(context.parent.flags & TraceFlags.SAMPLED),
                trace_state=state,
            )
            parent = trace.set_span_in_context(NonRecordingSpan(remote))
        name = method.decode("ascii", "replace")
        start_ns = time.time_ns() - int((time.monotonic() - started) * 1e9)
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.SERVER, start_time=start_ns,
            attributes={"http.request.method": name,
                        "url.path": target.split(b"?", 1)[0].decode("ascii", "replace"),
                        "clef.request_id": request_id})
        return RequestSpan(self, span, name)

    def shutdown(self, timeout_ms: int = FLUSH_TIMEOUT_MS) -> None:
        """Export what is pending and stop, within `timeout_ms` whatever the collector does.

        The provider's shutdown exports the queue, but with an unreachable collector the
        exporter retries for its whole timeout; on a thread of its own it cannot hold the
        process's exit past ours (the SDK's threads are daemons).
        """
        stopping = threading.Thread(target=self.provider.shutdown, daemon=True,
                                    name="otel-shutdown")
        stopping.start()
        stopping.join(timeout_ms / 1000)
        if stopping.is_alive():
            log.warning("traces: export not finished after %d ms; pending spans are dropped",
                        timeout_ms)


_active: Tracing | None = None


def start(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """Turn tracing on if the environment asks for it; TracingConfigError if it asks wrongly."""
    global _active
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return None
    _active = Tracing.from_environment(environ)
    log.info("traces: exporting over OTLP (%s) as service %s", protocol_of(environ),
             _active.provider.resource.attributes.get("service.name"))
    return _active


def stop() -> None:
    """Flush and shut tracing down (the server is exiting)."""
    global _active
    active, _active = _active, None
    if active is not None:
        active.shutdown()


def begin(context: TraceContext, method: bytes, target: bytes, request_id: str,
          started: float) -> tuple[str, RequestSpan | None]:
    """The request's trace id for the access line, and its span (None when not tracing): with
    tracing off the trace id is the caller's (`-` without a valid `traceparent`)."""
    if _active is None:
        return context.trace_id, None
    span = _active.begin(context, method, target, request_id, started)
    return span.trace_id, span


def end(span: RequestSpan | None, *, status: int, route: str, ticket: TicketView | None,
        answered_at: float | None, cache: str | None = None,
        shared_at: float | None = None, tenant: str = "-",
        reused_tokens: int | None = None) -> None:
    """Finish a request's spans from what the front measured (nothing when not tracing)."""
    if span is None:
        return
    reply = ticket.worker_reply if ticket is not None else None
    queued_at, sent_at = ticket.last_wait if ticket is not None else (None, None)
    span.finish(Finished(
        status=status, route=route, queued_at=queued_at, sent_at=sent_at,
        answered_at=answered_at if reply is not None or ticket is None else None,
        cache=cache, shared_at=shared_at,
        worker_ms=ticket.worker_ms if ticket is not None else None,
        stages=getattr(reply, "stages", None),
        batch_size=reply.batch_size if reply is not None else None,
        tenant=tenant if tenant != "-" else None,
        reused_tokens=reused_tokens,
    ))

"""Traces: W3C `traceparent`/`tracestate` in, OTLP spans out (to a loopback collector).

The server runs as in production (a subprocess, the fake worker behind it) with the standard
OTEL_* variables pointing at tests/otlp_collector.py, which decodes what arrives with
opentelemetry-proto. Waiting is a bounded condition on the collector, never a sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from clef_dispatch.resend import Resends
from clef_dispatch.ticket import AdmissionEvents, Ticket, TicketView
from clef_dispatch.urgency import CLASSES
from clef_dispatch.waiting import TicketQueue
from clef_dispatch.worker_errors import WorkerLost
from clef_frontend import otel
from clef_frontend.tracing import (
    NO_TRACE,
    TRACESTATE_MAX_CHARS,
    TraceContext,
    TraceParent,
    parse_traceparent,
    trace_context_of,
)
from clef_protocol.messages import WorkerReply
from tests.frontend_helpers import REPO, WAIT, Serve, clef_body, free_port
from tests.otlp_collector import Collector, ExportedSpan, grpc_collector, http_collector

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
# Export within a few milliseconds of a span ending, so tests wait briefly.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "20"}


# -- traceparent parsing (W3C Trace Context) ------------------------------------------------


def test_a_valid_traceparent_is_parsed() -> None:
    assert parse_traceparent(TRACEPARENT) == TraceParent(TRACE, PARENT, 1)
    unsampled = parse_traceparent(f"00-{TRACE}-{PARENT}-00")
    assert unsampled is not None and not unsampled.sampled


@pytest.mark.parametrize("value", [
    "",
    f"00-{TRACE.upper()}-{PARENT}-01",  # upper-case hex
    f"00-{'0' * 32}-{PARENT}-01",  # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
    f"00-{TRACE}-{PARENT}-01-extra",  # version 00 is exactly 55 characters
    f"ff-{TRACE}-{PARENT}-01",  # version ff is forbidden
    f"0-{TRACE}-{PARENT}-01",
    f"00-{TRACE[:-1]}-{PARENT}-01",  # short trace id
    f"00-{TRACE}-{PARENT[:-1]}-01",  # short parent id
    f"00-{TRACE}-{PARENT}-1",  # short flags
    f"00-{TRACE}-{PARENT}-zz",  # flags not hex
    f"00_{TRACE}_{PARENT}_01",  # wrong separators
    f"00-{TRACE[:-1]}g-{PARENT}-01",
    f"01-{TRACE}-{PARENT}-01x",  # a later version must continue with "-"
])
def test_an_invalid_traceparent_is_refused(value: str) -> None:
    assert parse_traceparent(value) is None


def test_a_later_version_is_read_as_far_as_known() -> None:
    assert parse_traceparent(f"cc-{TRACE}-{PARENT}-01-what-comes-next") == \
        TraceParent(TRACE, PARENT, 1)


def test_trace_context_and_request_id_in_one_pass() -> None:
    request_id, context = trace_context_of([
        (b"X-Request-Id", b"req-1"), (b"traceparent", TRACEPARENT.encode()),
        (b"tracestate", b"vendor=a"), (b"tracestate", b"other=b")])
    assert request_id == "req-1"
    assert context.trace_id == TRACE
    assert context.tracestate == "vendor=a,other=b"  # several headers are one list


def test_no_or_invalid_traceparent_means_no_parent_and_no_tracestate() -> None:
    _, none = trace_context_of([(b"tracestate", b"vendor=a")])
    assert none.parent is None and none.tracestate is None and none.trace_id == NO_TRACE
    _, bad = trace_context_of([(b"traceparent", b"00-nope"), (b"tracestate", b"vendor=a")])
    assert bad.parent is None and bad.tracestate is None
    twice = [(b"traceparent", TRACEPARENT.encode())] * 2  # which one would be the parent?
    assert trace_context_of(twice)[1].parent is None
    long_state = [(b"traceparent", TRACEPARENT.encode()),
                  (b"tracestate", b"v=" + b"x" * TRACESTATE_MAX_CHARS)]
    kept = trace_context_of(long_state)[1]
    assert kept.parent is not None and kept.tracestate is None


# -- what turns tracing on ------------------------------------------------------------------


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
])
def test_tracing_is_on_only_when_the_environment_asks(environ: dict[str, str],
                                                      expected: bool) -> None:
    assert otel.wanted(environ) is expected


def test_unsupported_settings_are_named() -> None:
    with pytest.raises(otel.TracingConfigError, match="http/json"):
        otel.protocol_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    assert otel.protocol_of({}) == "http/protobuf"
    assert otel.protocol_of({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
                             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"
    with pytest.raises(otel.TracingConfigError, match="zipkin"):
        otel.Tracing.from_environment({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_the_front_refuses_to_start_with_an_unsupported_protocol() -> None:
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9",
               OTEL_EXPORTER_OTLP_PROTOCOL="http/json")
    done = subprocess.run([sys.executable, "-m", "clef_frontend", "--port", "0"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "OTLP protocol 'http/json' is not supported" in done.stderr


def test_tracing_off_imports_no_sdk() -> None:
    """The base install has no OpenTelemetry: off must not even import it."""
    code = ("import sys; from clef_frontend import cli, otel, connection; "
            "from clef_frontend.tracing import TraceContext; "
            "assert otel.start({}) is None; otel.begin(TraceContext(), b'GET', b'/', 'r', 0.0); "
            "otel.stop(); print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- the queue span, per send ----------------------------------------------------------------

FIRST_WAIT, LAST_WAIT = 0.5, 0.25  # seconds: before the first send, before the resend
ON_LOST_WORKER = 60.0  # the first send's minute on a worker that was then lost


def _queue_span(ticket: Ticket, answered_at: float | None) -> tuple[float, float]:
    """The queue span `otel.end` gives a request on `ticket`: (start, end) in seconds, on the
    ticket's monotonic clock (an in-memory exporter, the span anchored as the server's are)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = otel.Tracing(provider, provider.get_tracer("test"))
    span = tracing.begin(TraceContext(), b"POST", b"/v1/systemone", "q-1", ticket.enqueued_at)
    anchor_ns, anchor = time.time_ns(), time.monotonic()
    otel.end(span, status=200 if answered_at is not None else 503, route="/v1/systemone",
             ticket=TicketView(ticket), answered_at=answered_at)
    [queue] = [s for s in exporter.get_finished_spans() if s.name == "queue"]
    assert queue.start_time is not None and queue.end_time is not None

    def seconds(ns: int) -> float:
        return anchor + (ns - anchor_ns) / 1e9

    return seconds(queue.start_time), seconds(queue.end_time)


def _lost_and_queued_again() -> tuple[Ticket, float]:
    """A ticket sent after FIRST_WAIT, lost with its worker a minute later and queued again by
    the dispatcher's own resend rule; the time it was queued again."""
    loop = asyncio.new_event_loop()
    ticket = Ticket(1, b"{}", loop.create_future(),
                    enqueued_at=time.monotonic() - FIRST_WAIT - ON_LOST_WORKER)
    loop.close()
    ticket.sent(ticket.enqueued_at + FIRST_WAIT)
    Resends(events=AdmissionEvents(), resend_timeout=30.0,
            keep_deadline=lambda _: None).lose(ticket, WorkerLost("died"))
    return ticket, ticket.waiting_since


def test_a_resent_requests_queue_span_is_its_last_sends_wait() -> None:
    """The queue span of a request resent after its worker was lost covers the wait before the
    resend only, never the minute on the lost worker: queue time per send, as the access line,
    Server-Timing and the histogram count it (their `queue_ms` is both sends' waits)."""
    ticket, requeued = _lost_and_queued_again()
    ticket.sent(requeued + LAST_WAIT)
    ticket.worker_reply, ticket.worker_ms = WorkerReply(200, b"{}", None, 1.0), 1.0
    start, end = _queue_span(ticket, answered_at=requeued + LAST_WAIT + 0.01)
    assert abs(start - requeued) < 1e-3 and abs(end - (requeued + LAST_WAIT)) < 1e-3
    assert end - start < FIRST_WAIT + LAST_WAIT < ON_LOST_WORKER
    assert abs(ticket.queue_ms - (FIRST_WAIT + LAST_WAIT) * 1000.0) < 1.0


def test_a_queue_span_without_a_resend_runs_from_the_queue_to_the_send() -> None:
    loop = asyncio.new_event_loop()
    ticket = Ticket(1, b"{}", loop.create_future(), enqueued_at=time.monotonic() - 1.0)
    loop.close()
    ticket.sent(ticket.enqueued_at + FIRST_WAIT)
    ticket.worker_reply, ticket.worker_ms = WorkerReply(200, b"{}", None, 1.0), 1.0
    start, end = _queue_span(ticket, answered_at=ticket.enqueued_at + 0.9)
    assert abs(start - ticket.enqueued_at) < 1e-3
    assert abs(end - (ticket.enqueued_at + FIRST_WAIT)) < 1e-3


def test_a_suspects_copy_that_never_went_leaves_the_answered_sends_wait() -> None:
    """A copy queued while a suspect worker held the ticket, which the suspect then answered:
    the span is the wait before that send, not the copy's wait."""
    loop = asyncio.new_event_loop()
    ticket = Ticket(1, b"{}", loop.create_future(), enqueued_at=time.monotonic() - 1.0)
    loop.close()
    ticket.sent(ticket.enqueued_at + FIRST_WAIT)
    waiting = {name: TicketQueue() for name in CLASSES}
    Resends(events=AdmissionEvents(), resend_timeout=30.0,
            keep_deadline=lambda _: None).copy([ticket], waiting)
    assert ticket.copied and ticket.waiting  # the copy waits
    ticket.worker_reply, ticket.worker_ms = WorkerReply(200, b"{}", None, 1.0), 1.0
    start, end = _queue_span(ticket, answered_at=time.monotonic())
    assert abs(start - ticket.enqueued_at) < 1e-3
    assert abs(end - (ticket.enqueued_at + FIRST_WAIT)) < 1e-3


def test_a_request_refused_while_queued_again_has_its_last_wait_to_the_end() -> None:
    """Lost with its worker, then refused before a resend (503): the span is its wait since it
    was queued again, ending with the request."""
    ticket, requeued = _lost_and_queued_again()
    before_end = time.monotonic()
    start, end = _queue_span(ticket, answered_at=None)
    assert abs(start - requeued) < 1e-3
    assert end >= before_end


# -- spans through the running server -------------------------------------------------------


@pytest.fixture
def collector() -> Iterator[tuple[Collector, str]]:
    yield from http_collector()


def _children(spans: list[ExportedSpan], parent: ExportedSpan) -> dict[str, ExportedSpan]:
    return {span.name: span for span in spans if span.parent_span_id == parent.span_id}


def _server_span(spans: list[ExportedSpan], request_id: str) -> ExportedSpan:
    found = [s for s in spans if s.attributes.get("clef.request_id") == request_id]
    assert len(found) == 1, spans
    return found[0]


def _has_request(request_id: str, names: int) -> Callable[[list[ExportedSpan]], bool]:
    """A predicate: the request's server span and `names - 1` children have arrived."""
    def done(spans: list[ExportedSpan]) -> bool:
        server = [s for s in spans if s.attributes.get("clef.request_id") == request_id]
        return bool(server) and len(_children(spans, server[0])) >= names - 1
    return done


def test_a_request_with_traceparent_is_traced_under_its_trace(
        collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "clef-test",
           **FAST_EXPORT}
    with Serve(env=env) as serve:
        response = serve.post(clef_body(), headers=[
            ("traceparent", TRACEPARENT), ("tracestate", "vendor=opaque"),
            ("X-Request-Id", "traced-1")])
        assert response.status == 200
        spans = sink.wait_spans(_has_request("traced-1", 3))  # (server, queue, worker)
        serve.wait_for(rf"request method=POST .* status=200 .* trace_id={TRACE} "
                       r"request_id=traced-1$")
    server = _server_span(spans, "traced-1")
    assert server.trace_id == TRACE
    assert server.parent_span_id == PARENT  # a child of the caller's span
    assert server.kind == SERVER_KIND
    assert server.name == "POST /v1/systemone"
    assert server.trace_state == "vendor=opaque"  # tracestate propagates
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["url.path"] == "/v1/systemone"
    assert server.attributes["http.response.status_code"] == 200
    assert server.resource["service.name"] == "clef-test"
    children = _children(spans, server)
    assert set(children) == {"queue", "worker"}
    for child in children.values():
        assert child.trace_id == TRACE
        assert server.start_ns <= child.start_ns <= child.end_ns <= server.end_ns
    assert children["queue"].end_ns <= children["worker"].end_ns
    assert children["worker"].attributes["clef.batch_size"] == 1


def test_a_repeat_answered_from_the_cache_has_a_cache_span(
        collector: tuple[Collector, str]) -> None:
    """The default configuration (answer cache on): a miss has its queue and worker spans, its
    repeat a `cache` span in their place, both with `clef.cache`, and Server-Timing says so."""
    sink, endpoint = collector
    body = clef_body()
    with Serve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}) as serve:
        first = serve.post(body, headers=[("X-Request-Id", "computed")])
        again = serve.post(body, headers=[("X-Request-Id", "repeated")])
        assert first.status == again.status == 200 and first.body == again.body
        timing = again.header("Server-Timing")
        assert timing is not None and timing.startswith("cache;desc=hit, total;dur=")
        spans = sink.wait_spans(lambda s: _has_request("computed", 3)(s)
                                and _has_request("repeated", 2)(s))
        serve.wait_for(r"status=200 .* cache=hit .* request_id=repeated$")
    computed, repeated = _server_span(spans, "computed"), _server_span(spans, "repeated")
    assert set(_children(spans, computed)) == {"queue", "worker"}
    assert computed.attributes["clef.cache"] == "miss"
    children = _children(spans, repeated)
    assert set(children) == {"cache"}
    assert children["cache"].attributes["clef.cache"] == "hit"
    assert repeated.start_ns <= children["cache"].start_ns <= children["cache"].end_ns \
        <= repeated.end_ns


def test_the_server_span_says_what_the_prefix_cache_gave(
        collector: tuple[Collector, str]) -> None:
    """A worker with a prefix cache (the fake's stand-in): the second request about a state
    carries the tokens its worker reused as `clef.prefix.reused_tokens`, as its Server-Timing
    and access line do; a request whose worker looked nothing up has no such attribute."""
    sink, endpoint = collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}
    with Serve("--fake-prefix-cache", env=env) as serve:
        for name, body in (("first", clef_body(state="a long shared state " * 20)),
                           ("second", clef_body(state="a long shared state " * 20 + "and more"))):
            response = serve.post(body, headers=[("X-Request-Id", name)])
            assert response.status == 200
        timing = response.header("Server-Timing") or ""
        reused = int(timing.split('prefix;desc="reused=')[1].split('"')[0])
        assert reused > 0
        serve.wait_for(rf"status=200 .* reused={reused} .* request_id=second$")
        spans = sink.wait_spans(lambda s: _has_request("first", 3)(s)
                                and _has_request("second", 3)(s))
    assert _server_span(spans, "first").attributes["clef.prefix.reused_tokens"] == 0
    assert _server_span(spans, "second").attributes["clef.prefix.reused_tokens"] == reused
    with Serve(env=env) as plain:  # no prefix cache on the worker: nothing to say
        assert plain.post(clef_body(), headers=[("X-Request-Id", "uncached")]).status == 200
        spans = sink.wait_spans(_has_request("uncached", 3))
        plain.wait_for(r"status=200 .* reused=- .* request_id=uncached$")
    assert "clef.prefix.reused_tokens" not in _server_span(spans, "uncached").attributes


def test_a_request_without_traceparent_starts_a_fresh_trace(
        collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    with Serve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}) as serve:
        first = serve.post(clef_body(), headers=[("X-Request-Id", "fresh-1")])
        second = serve.post(clef_body(), headers=[
            ("X-Request-Id", "fresh-2"), ("traceparent", f"00-{'0' * 32}-{PARENT}-01")])
        assert first.status == second.status == 200
        spans = sink.wait_spans(lambda s: all(_has_request(r, 3)(s)
                                              for r in ("fresh-1", "fresh-2")))
        one, two = _server_span(spans, "fresh-1"), _server_span(spans, "fresh-2")
        for server in (one, two):  # an invalid traceparent is ignored: a root span too
            assert server.parent_span_id == ""
            assert len(server.trace_id) == 32 and server.trace_id not in (TRACE, "0" * 32)
            assert server.resource["service.name"] == "clef-serve"
        assert one.trace_id != two.trace_id
        serve.wait_for(rf"status=200 .* trace_id={one.trace_id} request_id=fresh-1$")


def test_worker_stages_become_spans_ending_when_the_reply_arrived(
        collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    stages = {"encode_ms": 1.5, "forward_ms": 7.25, "head_ms": 0.5}
    with Serve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}) as serve:
        response = serve.post(clef_body(stages=stages), headers=[
            ("traceparent", TRACEPARENT), ("X-Request-Id", "staged")])
        assert response.status == 200
        spans = sink.wait_spans(_has_request("staged", 4))
    children = _children(spans, _server_span(spans, "staged"))
    assert set(children) == {"queue", "encode", "forward", "head"}
    encode, forward, head = children["encode"], children["forward"], children["head"]
    assert encode.end_ns == forward.start_ns and forward.end_ns == head.start_ns
    assert (encode.end_ns - encode.start_ns, forward.end_ns - forward.start_ns,
            head.end_ns - head.start_ns) == (1_500_000, 7_250_000, 500_000)


def test_an_unsampled_parent_exports_nothing_but_keeps_its_trace_id(
        collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    with Serve(env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, **FAST_EXPORT}) as serve:
        serve.post(clef_body(), headers=[("traceparent", f"00-{TRACE}-{PARENT}-00"),
                                         ("X-Request-Id", "unsampled")])
        serve.post(clef_body(), headers=[("X-Request-Id", "after")])
        serve.wait_for(rf"trace_id={TRACE} request_id=unsampled$")
        sink.wait_spans(_has_request("after", 3))
        serve.close()  # the exit flushes: anything of the unsampled request would be here
    assert not [s for s in sink.spans if s.trace_id == TRACE]


def test_spans_pending_at_shutdown_are_flushed(collector: tuple[Collector, str]) -> None:
    sink, endpoint = collector
    # A batch delay far longer than the test: only the exit's flush can deliver the spans.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    with Serve(env=env) as serve:
        assert serve.post(clef_body(), headers=[("X-Request-Id", "last")]).status == 200
        serve.terminate()
        assert serve.wait_exit() == 0
    sink.wait_spans(_has_request("last", 3), timeout=0.5)


def test_export_over_grpc() -> None:
    for sink, endpoint in grpc_collector():
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
               "OTEL_EXPORTER_OTLP_INSECURE": "true", **FAST_EXPORT}
        with Serve(env=env) as serve:
            serve.post(clef_body(), headers=[("traceparent", TRACEPARENT),
                                             ("X-Request-Id", "over-grpc")])
            spans = sink.wait_spans(_has_request("over-grpc", 3))
        assert _server_span(spans, "over-grpc").trace_id == TRACE


def test_without_tracing_the_access_line_still_names_the_callers_trace() -> None:
    with Serve() as serve:
        serve.post(clef_body(), headers=[("traceparent", TRACEPARENT),
                                         ("X-Request-Id", "off-1")])
        serve.post(clef_body(), headers=[("X-Request-Id", "off-2")])
        serve.wait_for(rf"trace_id={TRACE} request_id=off-1$")
        serve.wait_for(r"trace_id=- request_id=off-2$")
        assert "traces: exporting" not in serve.stderr


def test_the_access_line_of_a_refused_request_has_its_trace_too() -> None:
    with Serve() as serve:
        response = serve.post(b"{not json", headers=[("traceparent", TRACEPARENT),
                                                     ("X-Request-Id", "bad-json")])
        assert response.status == 400
        line = serve.wait_for(r"request method=POST .*request_id=bad-json$").group(0)
    assert f"trace_id={TRACE}" in line
    assert json.loads(response.body)["detail"]


def test_an_unreachable_collector_does_not_hold_the_exit() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    with Serve(env=env) as serve:
        assert serve.post(clef_body()).status == 200
        serve.terminate()
        assert serve.wait_exit(otel.FLUSH_TIMEOUT_MS / 1000 + WAIT) == 0
        serve.wait_for(r"traces: export not finished after \d+ ms; pending spans are dropped")

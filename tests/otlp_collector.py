"""A loopback OTLP trace collector for tests: OTLP/HTTP (protobuf) and OTLP/gRPC.

Each export is decoded with opentelemetry-proto's `ExportTraceServiceRequest`, the message a
real collector receives, so the tests check what would go over the wire, not what the SDK holds
in memory. Tests wait for spans with `wait_spans` (a condition with a deadline), never a sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

WAIT = 10.0


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None


@dataclass(frozen=True)
class ExportedSpan:
    """One received span, ids as lower-case hex as in `traceparent`."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    trace_state: str
    resource: dict[str, Any] = field(default_factory=dict)


class Collector:
    """Received spans, in arrival order; fed by the HTTP and gRPC servers below."""

    def __init__(self) -> None:
        self.spans: list[ExportedSpan] = []
        self.exports = 0
        self._changed = threading.Condition()

    def receive(self, payload: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(payload)
        self.receive_message(request)

    def receive_message(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ExportedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        trace_state=span.trace_state, resource=resource))
        with self._changed:
            self.spans.extend(received)
            self.exports += 1
            self._changed.notify_all()

    def wait_spans(self, predicate: Callable[[list[ExportedSpan]], bool],
                   timeout: float = WAIT) -> list[ExportedSpan]:
        """All spans so far, once `predicate(spans)` holds (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"spans never satisfied the condition: {self.spans}")
                self._changed.wait(left)
            return list(self.spans)


class _Handler(BaseHTTPRequestHandler):
    collector: Collector

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        payload = self.rfile.read(length)
        if self.path != "/v1/traces" or self.headers.get("Content-Type") != \
                "application/x-protobuf":
            self.send_response(404)
            self.end_headers()
            return
        self.collector.receive(payload)
        body = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, collector: Collector) -> None:
        self._collector = collector

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        self._collector.receive_message(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def http_collector() -> Iterator[tuple[Collector, str]]:
    """(collector, endpoint URL) of an OTLP/HTTP collector on loopback, for a fixture."""
    collector = Collector()
    handler = type("Handler", (_Handler,), {"collector": collector})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def grpc_collector() -> Iterator[tuple[Collector, str]]:
    """(collector, endpoint) of an OTLP/gRPC collector on loopback, for a fixture."""
    import grpc

    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(collector), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(None)

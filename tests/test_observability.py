"""Metrics, request ids and Server-Timing, through the real front and the fake worker."""

from __future__ import annotations

import io
import logging
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from clef_dispatch.worker_errors import (
    WorkerExited,
    WorkerFailure,
    WorkerHung,
    WorkerProtocolError,
    WorkerStalled,
    failure_reason,
)
from clef_frontend import tracing
from clef_protocol import messages
from clef_protocol.frames import encode_frame, read_frame_blocking
from clef_worker import logs as worker_logs
from clef_worker.main import serve as worker_serve
from tests.doubles import ScriptedExecutor
from tests.frontend_helpers import Response, Serve, clef_body

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Every sample, keyed by (name, labels), with prometheus_client's own parser."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def labels_of(samples: Samples, name: str) -> dict[str, str]:
    found = [dict(key[1]) for key in samples if key[0] == name]
    assert len(found) == 1, f"{name}: {found}"
    return found[0]


def scrape(serve: Serve) -> Samples:
    response = serve.request("GET", "/metrics")
    assert response.status == 200
    content_type = response.header("Content-Type")
    assert content_type is not None and content_type.startswith("text/plain")
    return parse_metrics(response.body.decode())


@pytest.fixture
def serve() -> Iterator[Serve]:
    with Serve() as server:
        yield server


# -- /metrics ----------------------------------------------------------------------------


def test_metrics_parse_and_move_with_requests_and_refusals(serve: Serve) -> None:
    before = scrape(serve)
    assert value(before, "clef_worker_ready") == 1.0
    assert value(before, "clef_queue_capacity") == 64.0
    assert labels_of(before, "clef_model_info")["model"] == "fake"
    assert labels_of(before, "clef_model_info")["version_fake_worker"] == "1"
    assert "version" in labels_of(before, "clef_build_info")

    assert serve.post(clef_body()).status == 200
    assert serve.post(clef_body()).status == 200
    assert serve.post(b'{"model": "m"}').status == 422  # refused by the front's validation
    assert serve.post(clef_body(error="nope")).status == 422  # refused by the worker
    assert serve.request("GET", "/nowhere").status == 404
    after = scrape(serve)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/systemone"
    assert moved("clef_http_requests_total", route=route, status="200", key="-") == 2
    assert moved("clef_http_requests_total", route=route, status="422", key="-") == 2
    assert moved("clef_http_requests_total", route="unknown", status="404", key="-") == 1
    assert moved("clef_http_requests_total", route="/metrics", status="200", key="-") == 1
    # Every scoring request has a total time; only the three the worker saw have queue/worker.
    assert moved("clef_request_duration_seconds_count") == 4
    assert moved("clef_request_queue_seconds_count", **{"class": "interactive"}) == 3
    assert moved("clef_request_worker_seconds_count") == 3
    assert value(after, "clef_queue_depth", **{"class": "interactive"}) == 0.0
    assert value(after, "clef_requests_in_flight") == 0.0


def test_workers_ai_requests_are_measured_like_systemone(serve: Serve) -> None:
    """The Workers-AI route is a scoring route: its requests reach the latency histograms (and
    the alerts built on them) under the route's template, never a client's account id."""
    before = scrape(serve)
    run = "/accounts/acct-7/ai/run/@cf/cloudflare/clef-flash"
    assert serve.request("POST", run, clef_body()).status == 200
    after = scrape(serve)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    template = "/accounts/{account_id}/ai/run/@cf/cloudflare/{model}"
    assert moved("clef_http_requests_total", route=template, status="200", key="-") == 1
    assert moved("clef_request_duration_seconds_count") == 1
    assert moved("clef_request_queue_seconds_count", **{"class": "interactive"}) == 1
    assert moved("clef_request_worker_seconds_count") == 1
    assert moved("clef_request_input_tokens_count") == 1


def test_queue_full_refusals_are_counted_as_503(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # One in flight, so the second request waits and the third finds the queue full.
    with Serve(front_args=("--queue-size", "1"), max_batch=1) as serve:
        running = serve.hold_in_flight(gate)
        queued = serve.queue(["waiting"])
        assert serve.post(clef_body()).status == 503
        samples = scrape(serve)
        assert value(samples, "clef_queue_depth", **{"class": "interactive"}) == 1.0
        assert value(samples, "clef_requests_in_flight") == 1.0
        assert value(samples, "clef_http_requests_total", route="/v1/systemone",
                     status="503", key="-") == 1
        gate.touch()
        assert running.result().status == 200
        assert queued[0].result().status == 200


@pytest.mark.parametrize(
    ("marker", "reason"),
    [("crash", "crash"), ("garbage", "protocol"), ("cuda_error", "cuda_error")],
)
def test_worker_restarts_are_counted_by_reason(marker: str, reason: str) -> None:
    # A worker lost with the request in flight gets it sent again (a poison request costs two
    # workers); one that answered 500 before exiting (cuda_error) does not.
    lost = 1 if reason == "cuda_error" else 2
    with Serve() as serve:
        assert serve.post(clef_body(**{marker: True})).status == 500
        serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == lost)
        samples = scrape(serve)
        for known in ("crash", "hung", "protocol", "cuda_error", "stalled"):
            expected = float(lost) if known == reason else 0.0
            assert value(samples, "clef_worker_restarts_total", reason=known) == expected
        assert serve.wait_for(rf"reason={reason}\)")


def test_a_hung_worker_counts_as_hung(tmp_path: Path) -> None:
    never = tmp_path / "never-created"
    with Serve(front_args=("--request-timeout", "1")) as serve:
        assert serve.post(clef_body(hold_until=str(never))).status == 500
        serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == 2)
        samples = scrape(serve)
        assert value(samples, "clef_worker_restarts_total", reason="hung") == 2.0
        assert value(samples, "clef_requests_resent_total", reason="hung") == 1.0


def test_input_tokens_and_truncation_are_counted(serve: Serve) -> None:
    # The fake worker reports the body's length as input_tokens (the real one: the sequence).
    short, cut = clef_body(), clef_body(truncated_tokens=1200, state="x" * 900)
    assert serve.post(short).status == 200
    assert serve.post(cut).status == 200
    assert serve.post(clef_body(error="refused")).status == 422  # no tokens for a refusal
    samples = scrape(serve)
    assert value(samples, "clef_request_input_tokens_count") == 2
    assert value(samples, "clef_request_input_tokens_sum") == len(short) + len(cut)
    assert value(samples, "clef_request_input_tokens_bucket", le="512.0") == 1
    assert value(samples, "clef_states_truncated_total") == 1
    assert value(samples, "clef_truncated_tokens_total") == 1200


def test_batch_sizes_are_counted_and_logged(serve: Serve) -> None:
    """Each answered request records the size of the worker forward that answered it."""
    assert serve.post(clef_body(batch_size=6)).status == 200
    assert serve.post(clef_body()).status == 200  # a worker that says nothing: ran alone
    assert serve.post(clef_body(error="refused")).status == 422  # no forward size
    samples = scrape(serve)
    assert value(samples, "clef_request_batch_size_count") == 2
    assert value(samples, "clef_request_batch_size_sum") == 7
    assert value(samples, "clef_request_batch_size_bucket", le="4.0") == 1
    assert serve.wait_for(r"request method=POST .* status=200 .* worker_ms=\S+ batch=6 ")
    assert serve.wait_for(r"request method=POST .* status=422 .* worker_ms=\S+ batch=- ")


def test_metrics_port_serves_during_warm_up_and_hides_public_metrics(tmp_path: Path) -> None:
    gate = tmp_path / "ready-gate"
    with Serve("--ready-gate", str(gate), front_args=("--metrics-port", "0"),
               wait_listening=False) as serve:
        port = int(serve.wait_for(r"metrics on http://[^\s:]+:(\d+)/metrics")[1])
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as answer:
            warming = parse_metrics(answer.read().decode())
        assert value(warming, "clef_worker_ready") == 0.0
        gate.touch()
        serve.port = int(serve.wait_for(r"listening on http://[^\s:]+:(\d+)")[1])
        assert serve.post(clef_body()).status == 200
        with urllib.request.urlopen(url, timeout=10) as answer:
            ready = parse_metrics(answer.read().decode())
        assert value(ready, "clef_worker_ready") == 1.0
        assert value(ready, "clef_http_requests_total", route="/v1/systemone",
                     status="200", key="-") == 1
        public = serve.request("GET", "/metrics")
        assert (public.status, public.detail) == (404, "unknown route")


def test_a_taken_metrics_port_stops_the_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with Serve(front_args=("--metrics-port", str(port)), wait_listening=False) as serve:
            assert serve.wait_exit() == 1
            assert "cannot serve metrics" in serve.stderr


# -- request ids and Server-Timing ------------------------------------------------------


def post_with_id(serve: Serve, request_id: str | None, body: bytes | None = None) -> Response:
    headers = [] if request_id is None else [("X-Request-Id", request_id)]
    return serve.post(body or clef_body(), headers=headers)


def test_a_valid_request_id_is_echoed_and_logged(serve: Serve) -> None:
    response = post_with_id(serve, "lb-7f3a:req/42")
    assert response.status == 200
    assert response.header("X-Request-Id") == "lb-7f3a:req/42"
    serve.wait_for(r"request method=POST .* status=200 .* request_id=lb-7f3a:req/42$")


@pytest.mark.parametrize(
    "sent", [None, "", "has space", "x" * 129, "tab\there", "caf\u00e9"],
    ids=["absent", "empty", "space", "too-long", "control", "non-ascii"],
)
def test_a_missing_or_invalid_request_id_is_replaced(serve: Serve, sent: str | None) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", clef_body(),
                    headers=[] if sent is None else [("X-Request-Id", sent)])
        response = client.read_response()
    assert response.status == 200
    made = response.header("X-Request-Id")
    assert made is not None and re.fullmatch(r"[0-9a-f]{32}", made)


def test_every_answer_carries_a_request_id(serve: Serve) -> None:
    assert serve.health().header("X-Request-Id")
    assert serve.request("GET", "/nowhere").header("X-Request-Id")
    assert post_with_id(serve, "r-415", b"{}").header("X-Request-Id") == "r-415"
    refused = serve.post(b"{}", content_type="text/plain", headers=[("X-Request-Id", "r-1")])
    assert (refused.status, refused.header("X-Request-Id")) == (415, "r-1")
    with serve.connect() as client:  # a head h11 refuses: still an id
        client.send_raw(b"GET /health HTTP/1.1\r\nHost test\r\n\r\n")
        assert client.read_response().header("X-Request-Id")


def test_the_request_id_reaches_the_worker_log_of_a_failing_request(serve: Serve) -> None:
    response = post_with_id(serve, "trace-500-abc",
                            clef_body(error="kernel exploded", error_status=500))
    assert (response.status, response.detail) == (500, "inference failed")
    assert response.header("X-Request-Id") == "trace-500-abc"
    line = serve.wait_for(r"clef-worker\[\d+\] ERROR request_id=trace-500-abc request \d+ "
                          r"failed: kernel exploded")
    assert line


def test_server_timing_shows_queue_and_worker(serve: Serve) -> None:
    response = serve.post(clef_body(sleep=0.05))
    timing = response.header("Server-Timing")
    assert timing is not None
    parts = dict(re.findall(r"(\w+);dur=([0-9.]+)", timing))
    assert set(parts) == {"queue", "worker", "total"}
    assert float(parts["worker"]) >= 50.0  # the fake worker slept 50 ms and reports it
    assert float(parts["total"]) >= float(parts["worker"])
    assert serve.health().header("Server-Timing") is None  # nothing queued, nothing to show


# -- units ----------------------------------------------------------------------------------


def test_request_id_rule() -> None:
    assert tracing.trace_context_of([(b"x-request-id", b"abc")])[0] == "abc"
    assert tracing.trace_context_of([(b"X-Request-ID", b"A" * 128)])[0] == "A" * 128
    assert tracing.trace_context_of([(b"x-request-id", b"A" * 129)])[0] != "A" * 129
    assert tracing.trace_context_of([(b"x-request-id", b"a\x7fb")])[0] != "a\x7fb"
    assert messages.is_request_id("!~") and not messages.is_request_id(7)
    assert tracing.server_timing(None, None, None) is None
    assert tracing.server_timing(0.25, None, 3.0) == "queue;dur=0.2, total;dur=3.0"


@pytest.mark.parametrize(
    ("failure", "code", "reason"),
    [(WorkerExited("closed"), 3, "cuda_error"), (WorkerExited("closed"), -9, "crash"),
     (WorkerHung("no reply"), -9, "hung"), (WorkerProtocolError("bad frame"), None, "protocol"),
     (WorkerExited("closed"), 2, "protocol"), (WorkerFailure("killed"), 70, "crash"),
     (WorkerStalled("silent"), -9, "stalled")],
)
def test_failure_reasons(failure: WorkerFailure, code: int | None, reason: str) -> None:
    assert failure_reason(failure, code) == reason


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_worker_log_lines_carry_the_frame_ids() -> None:
    """The request frame's request id and W3C trace id are on every worker line about it."""
    stream = io.StringIO()
    handler = worker_logs.configure(stream)
    try:
        frames = b"".join(encode_frame(m) for m in (
            messages.request(1, b'{"do": "boom"}', "abc-123", TRACE_ID),
            messages.request(2, b'{"do": "boom"}', "bad id with spaces"),
            messages.shutdown(),
        ))
        out = io.BytesIO()
        assert worker_serve(ScriptedExecutor(), io.BytesIO(frames), out) == 0
    finally:
        logging.getLogger().removeHandler(handler)
    text = stream.getvalue()
    assert re.search(rf"ERROR request_id=abc-123 trace_id={TRACE_ID} frame 1 failed:\n"
                     r"Traceback", text)
    assert re.search(r"ERROR request_id=- frame 2 failed:", text)
    assert "bad id with spaces" not in text
    assert re.search(r"INFO shutting down", text)  # outside a request: no id
    replies = io.BytesIO(out.getvalue())
    replies_read = [read_frame_blocking(replies) for _ in range(2)]
    assert [frame["status"] if frame else None for frame in replies_read] == [500, 500]

"""Every row of docs/http-contract.md, through a real socket, against one running clef-serve."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from tests.frontend_helpers import (
    REPO,
    Client,
    Serve,
    assert_refused_as_malformed,
    background,
    build_request,
    clef_body,
)

BODY_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(front_args=("--body-timeout", "1", "--header-timeout", "1",
                           "--keepalive-timeout", "2", "--queue-size", "8")) as server:
        yield server


def exact_error(detail: str) -> bytes:
    return json.dumps({"detail": detail}, ensure_ascii=False, allow_nan=False).encode()


# -- routes --------------------------------------------------------------------------------


def test_health_ready_reports_the_worker(serve: Serve) -> None:
    response = serve.health()
    assert response.status == 200
    assert response.header("Content-Type") == "application/json"
    document = response.json()
    assert document["status"] == "ready"
    assert document["worker"]["model"] == "fake"
    assert document["worker"]["thread"] == "MainThread"
    for key in ("pid", "device", "dtype", "gdn_path"):
        assert key in document["worker"]
    assert document["queue_depth"] == 0 and document["in_flight"] == 0
    assert document["restarts"] == 0


def test_the_documented_health_example_has_every_field_the_server_sends(serve: Serve) -> None:
    """operations.md's `/health` example names exactly the fields of a real answer."""
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text[text.index("## Health checks and load balancers"):]
    example = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    document = serve.health().json()
    assert set(example) == set(document)
    assert set(example["worker"]) == set(document["worker"])
    assert set(example["workers"][0]) == set(document["workers"][0])


def test_post_is_forwarded_byte_for_byte(serve: Serve) -> None:
    response = serve.post(clef_body(tag="fwd"))
    assert response.status == 200
    assert response.header("Content-Type") == "application/json"
    assert int(response.header("Content-Length") or -1) == len(response.body)
    document = response.json()
    assert document["tag"] == "fwd" and document["model"] == "m"
    # The fake worker writes json.dumps(document) with default separators and this key order:
    # any re-serialisation by the front would show here.
    assert response.body == json.dumps(document).encode()
    assert list(document)[:3] == ["model", "tag", "pid"]


@pytest.mark.parametrize("path", ["/", "/nope", "/health?x=1", "/v1/systemone?x=1",
                                  "/v1/systemone/", "/HEALTH", "*"])
def test_unknown_routes_are_404(serve: Serve, path: str) -> None:
    method = "POST" if path.startswith("/v1") else "GET"
    response = serve.request(method, path, clef_body())
    assert response.status == 404
    assert response.body == exact_error("unknown route")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/health", "GET"), ("PUT", "/health", "GET"), ("DELETE", "/health", "GET"),
    ("GET", "/v1/systemone", "POST"), ("PUT", "/v1/systemone", "POST"),
])
def test_wrong_method_is_405_with_allow(serve: Serve, method: str, path: str, allow: str) -> None:
    response = serve.request(method, path)
    assert response.status == 405
    assert response.header("Allow") == allow
    assert response.body == exact_error("method not allowed")


def test_head_gets_405_headers_without_body(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("HEAD", "/health")
        client.send("GET", "/health")
        first = client.read_response(head=True)
        assert first.status == 405 and first.header("Allow") == "GET"
        assert int(first.header("Content-Length") or 0) > 0
        # A HEAD answer carries no body: the next response starts right after its headers.
        assert client.read_response().status == 200


# -- POST checks, in contract order ------------------------------------------------------------


def raw_post(serve: Serve, head_lines: list[str], body: bytes = b"") -> tuple[int, bytes, bool]:
    """Send a hand-written POST head; (status, body, server closed the connection)."""
    head = "\r\n".join(["POST /v1/systemone HTTP/1.1", "Host: test", *head_lines]) + "\r\n\r\n"
    with serve.connect() as client:
        client.send_raw(head.encode("utf-8") + body)
        response = client.read_response()
        closed = response.header("Connection") == "close" and client.at_eof()
        return response.status, response.body, closed


ROW1 = exact_error("Content-Length is required; chunked requests are unsupported")
ROW2 = exact_error("one Content-Length is required")
ROW3 = exact_error("invalid Content-Length")


@pytest.mark.parametrize("lines", [
    ["Transfer-Encoding: chunked"],
    ["Transfer-Encoding: chunked", "Content-Length: 5"],
    ["Content-Length: 5", "Transfer-Encoding: chunked"],
    ["Transfer-Encoding: gzip"],
    ["Transfer-Encoding: gzip, chunked", "Content-Length: abc"],
    ["Transfer-Encoding: chunked", "Transfer-Encoding: chunked"],
    ["Transfer-Encoding: identity", "Content-Type: text/plain"],
])
def test_row1_any_transfer_encoding_is_411(serve: Serve, lines: list[str]) -> None:
    status, body, closed = raw_post(serve, ["Content-Type: application/json", *lines])
    assert (status, body, closed) == (411, ROW1, True)


@pytest.mark.parametrize("lines", [
    [],
    ["Content-Length: 5", "Content-Length: 5"],
    ["Content-Length: 5", "Content-Length: 6"],
    ["Content-Length: 5", "Content-Length: abc"],
])
def test_row2_not_exactly_one_content_length_is_411(serve: Serve, lines: list[str]) -> None:
    status, body, closed = raw_post(serve, ["Content-Type: application/json", *lines])
    assert (status, body, closed) == (411, ROW2, True)


@pytest.mark.parametrize("value", ["abc", "-1", "+2", "5, 5", "1.0", "0x10", "", "1 2", "١"])
def test_row3_non_decimal_content_length_is_400(serve: Serve, value: str) -> None:
    line = "Content-Length: " + value
    status, body, closed = raw_post(serve, ["Content-Type: application/json", line])
    assert (status, body, closed) == (400, ROW3, True)


def test_row4_over_the_body_limit_is_413_without_reading_the_body(serve: Serve) -> None:
    # The body is never sent: the 413 must arrive anyway, and the connection must close.
    status, body, closed = raw_post(
        serve, ["Content-Type: application/json", f"Content-Length: {BODY_LIMIT + 1}"])
    assert (status, body, closed) == (413, exact_error("request exceeds body limit"), True)


def test_row4_413_reaches_a_client_that_sends_the_body_anyway(serve: Serve) -> None:
    # The server answers without reading and closes; a plain close with unread input would
    # reset the connection, which can destroy the 413 before the client reads it.
    body = b"x" * (BODY_LIMIT + 1)
    with serve.connect() as client:
        sending = background(lambda: _send_ignoring_reset(client, body))
        response = client.read_response()
        assert response.status == 413
        sending.result()


def _send_ignoring_reset(client: Client, body: bytes) -> None:
    with contextlib.suppress(OSError):
        client.send("POST", "/v1/systemone", body)


def test_row4_huge_content_length_is_413(serve: Serve) -> None:
    status, body, _ = raw_post(serve, ["Content-Type: application/json",
                                       "Content-Length: " + "9" * 40])
    assert (status, body) == (413, exact_error("request exceeds body limit"))


def test_row4_comes_before_row5(serve: Serve) -> None:
    status, _, _ = raw_post(serve, ["Content-Type: text/plain",
                                    f"Content-Length: {BODY_LIMIT + 1}"])
    assert status == 413


def test_exactly_the_body_limit_is_accepted(serve: Serve) -> None:
    template = clef_body(tag="big", state="")
    padding = BODY_LIMIT - len(template)
    body = clef_body(tag="big", state="x" * padding)
    assert len(body) == BODY_LIMIT
    response = serve.post(body)
    assert response.status == 200
    assert response.json()["bytes"] == BODY_LIMIT


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/jsonx",
                                          "application/x-json", "json", ""])
def test_row5_media_type_refused(serve: Serve, content_type: str | None) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", clef_body(), content_type=content_type)
        response = client.read_response()
    assert response.status == 415
    assert response.body == exact_error("Content-Type must be application/json")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", " application/json ;q=1"])
def test_row5_media_type_accepted(serve: Serve, content_type: str) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", clef_body(), content_type=content_type)
        assert client.read_response().status == 200


def test_row6_stalled_body_is_408_then_close(serve: Serve) -> None:
    body = clef_body()
    with serve.connect() as client:
        client.send_raw(build_request("POST", "/v1/systemone", body)[: -len(body) // 2])
        response = client.read_response()  # after --body-timeout (1 s)
        assert response.status == 408
        assert response.body == exact_error("request body timed out")
        assert response.header("Connection") == "close"
        assert client.at_eof()


def test_row7_client_closing_mid_body_is_400_incomplete(serve: Serve) -> None:
    import socket

    body = clef_body()
    with serve.connect() as client:
        client.send_raw(build_request("POST", "/v1/systemone", body)[:-5])
        client.sock.shutdown(socket.SHUT_WR)  # still listening for the answer
        response = client.read_response()
        assert response.status == 400
        assert response.body == exact_error("incomplete body")


@pytest.mark.parametrize(("body", "detail"), [
    (b"", "request body must contain valid JSON and UTF-8 text"),
    (b"{\"model\": \"\xff\"}", "request body must contain valid JSON and UTF-8 text"),
    (b"{\"a\": \"\\ud800\"}", "request body must contain valid JSON and UTF-8 text"),
    (b"{\"a\": 1e999}", "request body must contain valid JSON and UTF-8 text"),
    (b"[" * 100000 + b"]" * 100000, "request body must contain valid JSON and UTF-8 text"),
    (b"[]", "request must be a JSON object"),
    (b"null", "request must be a JSON object"),
    (b"3", "request must be a JSON object"),
    (b"{\"a\": 1, \"a\": 2}", "duplicate JSON keys are not supported"),
    (b"{\"q\": {\"x\": 1, \"x\": 1}}", "duplicate JSON keys are not supported"),
    (b"{\"a\": NaN}", "non-finite JSON numbers are not supported"),
    (b"{\"a\": -Infinity}", "non-finite JSON numbers are not supported"),
])
def test_rows8_to_11_body_refusals_are_400(serve: Serve, body: bytes, detail: str) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", body)
        response = client.read_response()
        assert (response.status, response.body) == (400, exact_error(detail))
        # The body was read in full: the connection stays usable.
        client.send("GET", "/health")
        assert client.read_response().status == 200


@pytest.mark.parametrize(("request_", "detail"), [
    ({"model": "m"}, "model and state are required"),
    ({"model": 3, "state": "s", "questions": {"q": {"type": "noul"}}},
     "model and state are required"),
    ({"model": "m", "state": None, "questions": {}}, "at least one question is required"),
    ({"model": "m", "state": 1, "questions": {"q": {"type": "yes"}}},
     "q: type must be noul, choice, or score"),
    ({"model": "m", "state": 1, "questions": {"é": {"type": "choice"}}},
     "é: criteria must not be empty"),
])
def test_row12_invalid_requests_are_422(serve: Serve, request_: dict, detail: str) -> None:
    response = serve.post(json.dumps(request_).encode())
    assert response.status == 422
    assert response.body == exact_error(detail)  # non-ASCII kept as UTF-8, not escaped


def test_worker_422_is_forwarded(serve: Serve) -> None:
    response = serve.post(clef_body(error="schema requires 99 tokens before state; maximum is 5"))
    assert response.status == 422
    assert response.body == exact_error("schema requires 99 tokens before state; maximum is 5")


def test_row13_worker_500_is_inference_failed(serve: Serve) -> None:
    response = serve.post(clef_body(error="CUDA out of memory at layer 3", error_status=500))
    assert response.status == 500
    assert response.body == exact_error("inference failed")
    assert serve.health().status == 200  # an executor error does not cost the worker


# -- connection handling -----------------------------------------------------------------------


def test_keep_alive_reuses_the_connection(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", clef_body(tag="one"))
        first = client.read_response()
        client.send("POST", "/v1/systemone", clef_body(tag="two"))
        second = client.read_response()
    assert first.header("Connection") is None
    assert [first.json()["tag"], second.json()["tag"]] == ["one", "two"]


def test_pipelined_requests_are_answered_in_order(serve: Serve) -> None:
    tags = [f"p{i}" for i in range(6)]
    burst = b"".join(build_request("POST", "/v1/systemone", clef_body(tag=t)) for t in tags)
    burst += build_request("GET", "/nope") + build_request("GET", "/health")
    burst += build_request("POST", "/v1/systemone", b"[]")
    burst += build_request("POST", "/v1/systemone", clef_body(tag="last"))
    with serve.connect() as client:
        client.send_raw(burst)
        answers = [client.read_response() for _ in range(len(tags) + 4)]
    assert [a.json()["tag"] for a in answers[: len(tags)]] == tags
    assert [a.status for a in answers[len(tags):]] == [404, 200, 400, 200]
    assert answers[-1].json()["tag"] == "last"
    ids = [a.json()["request_id"] for a in answers[: len(tags)]]
    assert ids == sorted(ids)


def test_http10_closes_after_the_response(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("GET", "/health", version="HTTP/1.0")
        assert client.read_response().status == 200
        assert client.at_eof()


def test_connection_close_is_honoured(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("POST", "/v1/systemone", clef_body(), headers=[("Connection", "close")])
        response = client.read_response()
        assert response.status == 200 and response.header("Connection") == "close"
        assert client.at_eof()


def test_oversize_header_block_is_431(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("GET", "/health", headers=[("X-Big", "a" * 20000)])
        response = client.read_response()
        assert response.status == 431
        assert response.body == exact_error("request header block too large")
        assert client.at_eof()


def test_header_block_just_over_the_limit_is_431(serve: Serve) -> None:
    head = build_request("GET", "/health")
    padding = 16 * 1024 - len(head) + 1 - len("X-Pad: \r\n")
    with serve.connect() as client:
        client.send("GET", "/health", headers=[("X-Pad", "p" * padding)])
        assert client.read_response().status == 431
    with serve.connect() as client:  # and one byte less is fine
        client.send("GET", "/health", headers=[("X-Pad", "p" * (padding - 1))])
        assert client.read_response().status == 200


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET /health\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
    b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS hello on a plain port
])
def test_malformed_heads_get_400_and_close(serve: Serve, raw: bytes) -> None:
    assert_refused_as_malformed(serve, raw)


def test_stalled_head_is_dropped_without_response(serve: Serve) -> None:
    with serve.connect() as client:
        client.send_raw(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert client.at_eof()  # after --header-timeout (1 s), nothing was written


def test_idle_keep_alive_is_closed_quietly(serve: Serve) -> None:
    with serve.connect() as client:
        client.send("GET", "/health")
        assert client.read_response().status == 200
        assert client.at_eof()  # after --keepalive-timeout (2 s)


def test_expect_100_continue(serve: Serve) -> None:
    body = clef_body(tag="expect")
    with serve.connect() as client:
        head = build_request("POST", "/v1/systemone", body, headers=[("Expect", "100-continue")])
        client.send_raw(head[: -len(body)])
        line = client._file.readline()
        assert line.startswith(b"HTTP/1.1 100")
        assert client._file.readline() == b"\r\n"
        client.send_raw(body)
        assert client.read_response().json()["tag"] == "expect"


@pytest.mark.parametrize("framing", ["Content-Length: abc", "Transfer-Encoding: gzip",
                                     "Content-Length: 1\r\nContent-Length: 2"])
def test_other_routes_with_unreadable_framing_close_after_answering(
    serve: Serve, framing: str
) -> None:
    smuggled = build_request("GET", "/v1/systemone")
    with serve.connect() as client:
        client.send_raw(f"GET /health HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode()
                        + smuggled)
        response = client.read_response()
        assert response.status == 200 and response.header("Connection") == "close"
        assert client.at_eof()  # the bytes after the head were never taken as a request


def test_get_with_body_is_answered_and_closed(serve: Serve) -> None:
    with serve.connect() as client:
        client.send_raw(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        response = client.read_response()
        assert response.status == 200 and response.header("Connection") == "close"
        assert client.at_eof()

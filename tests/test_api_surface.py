"""`/v1/models`, the Workers-AI route and its envelope, and X-Clef-State-Truncated, through a real
socket against clef-serve with the fake worker.

The envelope tests are twins: the same bytes go to `/v1/systemone` and to the Workers-AI path,
and the Workers-AI answer must be the plain answer's status, headers and detail in Cloudflare's
envelope, at every stage that can refuse a request.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime
from pathlib import Path

import pytest

from tests.frontend_helpers import Client, Response, Serve, build_request, clef_body

RUN = "/accounts/acct-123/ai/run/@cf/cloudflare/clef-flash"
PLAIN = "/v1/systemone"


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(front_args=("--body-timeout", "1", "--header-timeout", "1",
                           "--served-model-name", "clef-flash", "flash-alias")) as server:
        yield server


def envelope_error(status: int, message: str) -> dict[str, object]:
    return {"result": None, "success": False, "errors": [{"code": status, "message": message}],
            "messages": []}


def exchange(serve: Serve, raw: bytes, *, half_close: bool = False) -> Response:
    with serve.connect() as client:
        client.send_raw(raw)
        if half_close:
            client.sock.shutdown(socket.SHUT_WR)
        return client.read_response()


# -- /v1/models --------------------------------------------------------------------------------


def test_models_lists_the_served_name_then_aliases(serve: Serve) -> None:
    response = serve.request("GET", "/v1/models")
    assert response.status == 200
    document = response.json()
    assert document["object"] == "list"
    assert [model["id"] for model in document["data"]] == ["clef-flash", "flash-alias"]
    for model in document["data"]:
        assert model["object"] == "model" and model["owned_by"] == "cloudflare"
        assert isinstance(model["created"], int) and model["root"] == "clef-flash"


def test_models_answers_the_clef_sdk_shape_in_the_same_body(serve: Serve) -> None:
    """The typesafe Clef SDK and jevcompat read `models[].name/description/release_date`."""
    document = serve.request("GET", "/v1/models").json()
    assert [model["name"] for model in document["models"]] == ["clef-flash", "flash-alias"]
    for clef, openai in zip(document["models"], document["data"], strict=True):
        assert set(clef) == {"name", "description", "release_date"}
        assert clef["name"] == openai["id"] and clef["description"]
        day = datetime.fromtimestamp(openai["created"], UTC).date()
        assert date.fromisoformat(clef["release_date"]) == day
    assert document["models"][1]["description"] == "alias of clef-flash"


def test_models_default_name_is_the_variant() -> None:
    with Serve(front_args=("--variant", "clef")) as server:
        ids = [model["id"] for model in server.request("GET", "/v1/models").json()["data"]]
        assert ids == ["clef"]
        assert server.post(clef_body()).status == 200
        run = server.request("POST", "/accounts/a/ai/run/@cf/cloudflare/clef", clef_body())
        assert run.status == 200


def test_models_is_get_only(serve: Serve) -> None:
    response = serve.request("POST", "/v1/models", b"{}")
    assert (response.status, response.header("Allow")) == (405, "GET")


# -- the Workers-AI route ------------------------------------------------------------------------


@pytest.mark.parametrize("path", [RUN, "/accounts/x/ai/run/@cf/cloudflare/flash-alias",
                                  "/accounts/x/ai/run/%40cf/cloudflare/clef-flash"])
def test_success_wraps_the_systemone_body_unchanged(serve: Serve, path: str) -> None:
    plain = serve.post(clef_body(tag="same"))
    run = serve.request("POST", path, clef_body(tag="same"))
    assert run.status == 200
    assert run.body.startswith(b'{"result": {"model": "m", "tag": "same", ')
    assert run.body.endswith(b'}, "success": true, "errors": [], "messages": []}')
    document = run.json()
    assert set(document) == {"result", "success", "errors", "messages"}
    # Same shape as the plain answer; only the fake worker's per-request fields differ.
    assert set(document["result"]) == set(plain.json())
    assert document["result"]["tag"] == "same"


@pytest.mark.parametrize("path", [
    "/accounts/x/ai/run/@cf/cloudflare/clef",
    "/accounts/x/ai/run/@cf/meta/llama-3-8b",
    "/accounts/x/ai/run/clef-flash",
])
def test_unknown_model_is_404_in_the_envelope(serve: Serve, path: str) -> None:
    response = serve.request("POST", path, clef_body())
    assert response.status == 404
    document = response.json()
    message = document["errors"][0]["message"]
    assert document == envelope_error(404, message)
    assert message.startswith("unknown model '") and "@cf/cloudflare/clef-flash" in message


def test_a_query_string_makes_the_path_unknown(serve: Serve) -> None:
    response = serve.request("POST", RUN + "?x=1", clef_body())
    assert (response.status, response.json()) == (404, {"detail": "unknown route"})


def test_the_account_id_is_logged_and_selects_nothing(serve: Serve) -> None:
    response = serve.request("POST", "/accounts/team-7f3a/ai/run/@cf/cloudflare/clef-flash",
                             clef_body())
    assert response.status == 200
    serve.wait_for(r"path=/accounts/team-7f3a/ai/run/@cf/cloudflare/clef-flash status=200")


def _post(body: bytes, **options: object) -> Callable[[str], bytes]:
    return lambda path: build_request("POST", path, body, **options)  # type: ignore[arg-type]


def _partial(path: str) -> bytes:
    raw = build_request("POST", path, clef_body())
    return raw[:-5]


TWINS: dict[str, tuple[Callable[[str], bytes], bool]] = {
    "row1-transfer-encoding": (_post(b"", content_length=False,
                                     headers=[("Transfer-Encoding", "chunked")]), False),
    "row2-no-content-length": (_post(b"", content_length=False), False),
    "row3-bad-content-length": (_post(b"", content_length=False,
                                      headers=[("Content-Length", "abc")]), False),
    "row4-over-the-limit": (_post(b"", content_length=False,
                                  headers=[("Content-Length", str(8 * 1024 * 1024 + 1))]), False),
    "row5-media-type": (_post(clef_body(), content_type="text/plain"), False),
    "row6-body-timeout": (_partial, False),
    "row7-incomplete-body": (_partial, True),
    "row8-not-json": (_post(b"{\"model\": "), False),
    "row9-not-an-object": (_post(b"[]"), False),
    "row10-duplicate-keys": (_post(b"{\"a\": 1, \"a\": 2}"), False),
    "row11-non-finite": (_post(b"{\"a\": NaN}"), False),
    "row12-validation": (_post(b"{\"model\": \"m\"}"), False),
    "worker-422": (_post(clef_body(error="q: refused by the model")), False),
    "row13-worker-500": (_post(clef_body(error="Traceback: secret", error_status=500)), False),
    "405-wrong-method": (lambda path: build_request("GET", path), False),
    "431-header-block": (lambda path: build_request("POST", path, clef_body(),
                                                    headers=[("X-Big", "a" * 20000)]), False),
    "400-malformed-head": (lambda path: f"POST {path} HTTP/1.1\r\nHost: x\r\nbad header\r\n"
                                        "\r\n".encode(), False),
}


@pytest.mark.parametrize("case", list(TWINS))
def test_every_error_is_the_plain_error_in_the_envelope(serve: Serve, case: str) -> None:
    build, half_close = TWINS[case]
    plain = exchange(serve, build(PLAIN), half_close=half_close)
    run = exchange(serve, build(RUN), half_close=half_close)
    assert plain.status >= 400
    assert run.status == plain.status
    assert run.json() == envelope_error(plain.status, plain.detail)
    assert "secret" not in plain.detail
    for header in ("Allow", "Retry-After", "Connection", "Content-Type"):
        assert run.header(header) == plain.header(header), header


def test_503_keeps_retry_after_in_the_envelope(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    # One in flight, so the second request waits and the third finds the queue full.
    with Serve(front_args=("--queue-size", "1", "--retry-after", "3"), max_batch=1) as server:
        running = server.hold_in_flight(gate)
        queued = server.queue(["waiting"])
        plain = server.post(clef_body())
        run = server.request("POST", RUN, clef_body())
        gate.touch()
        assert running.result().status == 200 and queued[0].result().status == 200
    assert (plain.status, plain.header("Retry-After")) == (503, "3")
    assert (run.status, run.header("Retry-After")) == (503, "3")
    assert run.json() == envelope_error(503, plain.detail)


# -- X-Clef-State-Truncated ----------------------------------------------------------------------


@pytest.mark.parametrize("path", [PLAIN, RUN])
def test_truncation_header_carries_the_dropped_tokens(serve: Serve, path: str) -> None:
    cut = serve.request("POST", path, clef_body(truncated_tokens=1234))
    assert (cut.status, cut.header("X-Clef-State-Truncated")) == (200, "1234")
    whole = serve.request("POST", path, clef_body())
    assert (whole.status, whole.header("X-Clef-State-Truncated")) == (200, None)


def test_keep_alive_continues_on_the_workers_ai_route(serve: Serve) -> None:
    with serve.connect() as client:
        for tag in ("one", "two"):
            client.send("POST", RUN, clef_body(tag=tag))
            response = client.read_response()
            assert response.status == 200 and response.json()["result"]["tag"] == tag
        _assert_open(client)


def _assert_open(client: Client) -> None:
    client.send("GET", "/health")
    assert client.read_response().status == 200


def test_metrics_label_the_route_by_its_template(serve: Serve) -> None:
    assert serve.request("POST", "/accounts/acct-label-test/ai/run/@cf/cloudflare/clef-flash",
                         clef_body()).status == 200
    assert serve.request("GET", "/accounts/acct-label-test/ai/run/@cf/cloudflare/x").status == 405
    metrics = serve.request("GET", "/metrics").body.decode()
    template = "/accounts/{account_id}/ai/run/@cf/cloudflare/{model}"
    assert f'clef_http_requests_total{{key="-",route="{template}",status="200"}}' in metrics
    assert f'clef_http_requests_total{{key="-",route="{template}",status="405"}}' in metrics
    assert "acct-label-test" not in metrics  # client-chosen path parts never become labels

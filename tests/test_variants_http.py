"""Fine-tuned variants through one server in the configuration operators run (answer cache on,
batching on, the worker's CPU defaults) with `--finetune` naming the fixture directory: each
variant answers as the reference does on its merged release, the base's golden answers are
unchanged, base and variant requests interleaved at C8 each get their own answer, and the names
are routed: `/v1/models` lists the variants, `/health` describes them, the Workers-AI route takes
them, any other name is 404, and metrics and the access log carry the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from benchlib.golden import answered, assert_response_matches
from benchlib.paths import FINETUNE_FIXTURES, FINETUNE_REFERENCE
from clef_protocol.options import RequestLimits
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric

DEFAULT_MAX_LENGTH = RequestLimits().max_length
REFERENCE = [json.loads(line) for line in FINETUNE_REFERENCE.read_text().splitlines() if line]
ROWS = [row for row in REFERENCE if row["max_length"] == DEFAULT_MAX_LENGTH]
SERVED = "clef-flash"


def _served(case: dict[str, Any]) -> dict[str, Any]:
    """A golden case under the served name: with variants configured, a name the server does
    not serve is 404 (the golden file has one, `jev-latest`, that the reference accepts)."""
    if case["request"]["model"] == SERVED:
        return case
    return dict(case, request=dict(case["request"], model=SERVED),
                response=dict(case["response"], model=SERVED))


BASE = [_served(case) for case in answered() if case["max_length"] == DEFAULT_MAX_LENGTH]
RUN_PATH = "/accounts/acct/ai/run/@cf/cloudflare/"


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(real_worker=True, startup_wait=240, max_batch=None,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                           "--finetune", str(FINETUNE_FIXTURES))) as server:
        yield server


def _post(serve: Serve, request: dict[str, Any], path: str = "/v1/systemone") -> Any:
    body = json.dumps(request, ensure_ascii=False).encode()
    if path == "/v1/systemone":
        return serve.post(body)
    return serve.request("POST", path, body)


def test_every_variant_case_and_every_base_case(serve: Serve) -> None:
    for row in ROWS:
        response = _post(serve, row["request"])
        assert response.status == 200, (row["variant"], row["name"], response.body)
        assert_response_matches(response.json(), row["response"])
    for case in BASE:
        response = _post(serve, case["request"])
        assert response.status == 200, (case["name"], response.body)
        assert_response_matches(response.json(), case["response"])


def test_interleaved_at_c8_each_gets_its_own_answer(serve: Serve) -> None:
    """The same requests under the base's and both variants' names, eight at a time: a group
    mixes models, and the answer cache (on, as operators run it) keys on the model too."""
    expected: list[tuple[dict[str, Any], dict[str, Any]]] = []
    by_variant = {(row["variant"], row["name"]): row for row in ROWS}
    for case in BASE[:8]:
        expected.append((case["request"], case["response"]))
        for variant in ("tiny-alpha", "tiny-beta"):
            row = by_variant[(variant, case["name"])]
            expected.append((row["request"], row["response"]))

    def check(pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
        response = _post(serve, pair[0])
        assert response.status == 200, response.body
        assert_response_matches(response.json(), pair[1])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(check, expected * 2))


def test_models_health_and_workers_ai(serve: Serve) -> None:
    models = serve.request("GET", "/v1/models").json()
    assert [entry["id"] for entry in models["data"]] == ["clef-flash", "tiny-alpha", "tiny-beta"]
    assert {entry["root"] for entry in models["data"]} == {"clef-flash"}
    described = {m["name"]: m["description"] for m in models["models"]}
    assert described["tiny-alpha"].startswith("fine-tuned variant of clef-flash")

    finetunes = serve.health().json()["worker"]["finetunes"]
    assert [(f["name"], f["rank"], f["scale"]) for f in finetunes] == [
        ("tiny-alpha", 4, 2.0), ("tiny-beta", 2, 0.5)]
    assert finetunes[0]["head"].endswith("tiny-alpha/joint_head.safetensors")
    assert {f["base_model_name_or_path"] for f in finetunes} == {"tests/fixtures/clef-tiny"}

    row = ROWS[0]
    response = _post(serve, row["request"], RUN_PATH + row["variant"])
    assert response.status == 200, response.body
    assert response.json()["success"] is True
    assert_response_matches(response.json()["result"], row["response"])
    # The body and the path must agree when either names a variant.
    mismatch = _post(serve, dict(row["request"], model="clef-flash"), RUN_PATH + row["variant"])
    assert mismatch.status == 422
    assert "the body names 'clef-flash' but the path runs 'tiny-alpha'" in \
        mismatch.json()["errors"][0]["message"]


def test_an_unknown_model_is_404_naming_it_as_sent(serve: Serve) -> None:
    request = dict(BASE[0]["request"], model="tiny-gamma")
    response = _post(serve, request)
    assert response.status == 404
    assert response.detail == ("unknown model 'tiny-gamma'; this server runs clef-flash, "
                               "tiny-alpha, tiny-beta")
    path = serve.request("POST", RUN_PATH + "tiny-gamma", json.dumps(BASE[0]["request"]).encode())
    assert path.status == 404
    renamed = next(case for case in answered() if case["request"]["model"] != SERVED)
    assert _post(serve, renamed["request"]).status == 404


def test_metrics_and_access_log_carry_the_model(serve: Serve) -> None:
    before = metric(serve, "clef_model_requests_total", model="tiny-beta", status="200")
    row = next(r for r in ROWS if r["variant"] == "tiny-beta")
    assert _post(serve, row["request"]).status == 200
    assert metric(serve, "clef_model_requests_total", model="tiny-beta",
                  status="200") == before + 1
    assert metric(serve, "clef_model_requests_total", model="tiny-gamma", status="404") == 0
    serve.wait_for(r"path=/v1/systemone status=200 .* model=tiny-beta ")

"""The whole server with the real worker on the shared tiny snapshot: HTTP in, golden out."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from benchlib.golden import assert_response_matches, case
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Response, Serve


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(
        real_worker=True, startup_wait=240,
        front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu"),
    ) as server:
        yield server


def _post(serve: Serve, request: dict[str, Any]) -> Response:
    return serve.post(json.dumps(request).encode())


def test_health_reports_the_real_worker(serve: Serve) -> None:
    health = serve.health()
    assert health.status == 200
    worker = health.json()["worker"]
    assert worker["thread"] == "MainThread"
    assert (worker["device"], worker["dtype"], worker["gdn_path"]) == ("cpu", "float32", "torch")
    assert worker["demo"] is True  # the fixture is marked as a tiny random model
    # The real worker answers pings, so the front watches it for stalls even while it is idle.
    assert worker["pings"] is True
    # The start-up self-check (on by default): CPU's default layout agreed with the eager
    # one-by-one answers within the float32 bound, and the metric says the same.
    check = worker["self_check"]
    assert (check["passed"], check["layout"], check["fell_back_from"]) == (True, "per-group", [])
    assert check["checked"] >= 7 and 0.0 <= check["max_abs_diff"] <= 1e-4
    metrics = serve.request("GET", "/metrics").body.decode()
    assert 'clef_worker_self_check_passed{layout="per-group"} 1.0' in metrics
    assert 'clef_worker_self_check_fallbacks{layout="per-group"} 0.0' in metrics
    # Checked now, or kept from an earlier start in this session on the same weights and code.
    reused = "1.0" if check["reused"] else "0.0"
    assert f'clef_worker_self_check_reused{{layout="per-group"}} {reused}' in metrics


@pytest.mark.parametrize("name", ["invoice", "unicode_ids", "choice_sort_order", "object_state",
                                  "score_object_levels", "twelve_questions"])
def test_golden_answers_over_http(serve: Serve, name: str) -> None:
    golden = case(name)
    response = _post(serve, golden["request"])
    assert response.status == 200, response.body
    assert response.header("Content-Type") == "application/json"
    assert_response_matches(response.json(), golden["response"])
    # The worker's compact bytes, not a re-serialisation by the front.
    assert response.body == json.dumps(response.json(), ensure_ascii=False,
                                       separators=(",", ":")).encode()


@pytest.mark.parametrize("name", ["bad_type", "empty_criteria", "missing_model", "no_questions"])
def test_golden_refusals_over_http(serve: Serve, name: str) -> None:
    response = _post(serve, case(name)["request"])
    assert response.status == 422
    assert response.detail == case(name)["error"]["message"]


def test_token_budget_refusal_comes_from_the_worker(serve: Serve) -> None:
    options = {f"option_{i:03d}": f"a long description of option number {i}" for i in range(200)}
    questions = {f"q{k}": {"type": "choice", "criteria": options} for k in range(20)}
    response = _post(serve, {"model": "m", "state": "s", "questions": questions})
    assert response.status == 422
    assert re.fullmatch(r"schema requires \d+ tokens before state; maximum is 16384",
                        response.detail)
    serve.wait_for(r"status=422 queue_ms=[\d.]+ worker_ms=[\d.]+")  # it did reach the worker


def test_worker_ignores_sigterm_and_sigint(serve: Serve) -> None:
    """Only the front decides when the worker stops (shutdown frame after draining)."""
    pid = serve.health().json()["worker"]["pid"]
    os.kill(pid, signal.SIGTERM)
    os.kill(pid, signal.SIGINT)
    response = _post(serve, case("null_state")["request"])
    assert response.status == 200
    assert_response_matches(response.json(), case("null_state")["response"])
    health = serve.health().json()
    assert health["worker"]["pid"] == pid and health["restarts"] == 0

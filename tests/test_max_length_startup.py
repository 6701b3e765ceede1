"""Any valid `--max-length` starts the server: the warm-up is derived from the limits.

On the shared tiny snapshot the smallest schema needs more than 64 tokens and the golden cases
use 200 and 420; a fixed warm-up request used to stop the worker from starting at all of them.
Here each length starts the real server, and what cannot fit is a 422, never a failed start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from benchlib.golden import assert_response_matches, load_cases
from clef_worker.starting.warmup import REPRESENTATIVE
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve

BUDGET_REFUSAL = r"schema requires \d+ tokens before state; maximum is {}"


@pytest.fixture(scope="module", params=[48, 64, 200, 420])
def limited(request: pytest.FixtureRequest) -> Iterator[tuple[int, Serve]]:
    max_length: int = request.param
    with Serve(real_worker=True, startup_wait=240, front_args=(
            "--model", str(TINY_SNAPSHOT), "--device", "cpu",
            "--max-length", str(max_length))) as server:
        yield max_length, server


def test_starts_ready_and_refuses_what_cannot_fit(limited: tuple[int, Serve]) -> None:
    max_length, serve = limited
    assert serve.health().status == 200
    # The representative request (a schema of several hundred tokens) fits none of these.
    response = serve.post(json.dumps(REPRESENTATIVE).encode())
    assert response.status == 422
    assert re.fullmatch(BUDGET_REFUSAL.format(max_length), response.detail)
    warmed = serve.wait_for(r"warm-up done in [\d.]+ ms \((\d+) tokens\)|no request fits")
    if warmed[1] is not None:
        assert int(warmed[1]) <= max_length


def test_golden_cases_at_this_length_are_served(limited: tuple[int, Serve]) -> None:
    max_length, serve = limited
    cases = [c for c in load_cases() if c["max_length"] == max_length]
    for golden in cases:
        response = serve.post(json.dumps(golden["request"]).encode())
        if "error" in golden:
            assert (response.status, response.detail) == (422, golden["error"]["message"])
        else:
            assert response.status == 200, response.body
            assert_response_matches(response.json(), golden["response"])
    expected = {200: {"schema_too_long"}, 420: {"truncated_state"}}.get(max_length, set())
    assert {c["name"] for c in cases} == expected

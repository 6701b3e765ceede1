"""Every golden case through one server in the configuration operators run (answer cache on,
batching on): each case once, again (now answered from the cache), then the whole set again in
reverse order, every answer the reference's. The reordered pair (`invoice`,
`invoice_reordered`) is the same request with its questions in another order: it must get its
own answer, never the other's from the cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from benchlib.golden import assert_response_matches, load_cases
from clef_protocol.options import RequestLimits
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric

DEFAULT_MAX_LENGTH = RequestLimits().max_length
CASES = load_cases()
MAX_LENGTHS = sorted({case["max_length"] for case in CASES})


@pytest.fixture(scope="module", params=MAX_LENGTHS, ids=lambda m: f"max_length={m}")
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Serve, list[dict[str, Any]]]]:
    """A server with every default but the snapshot, the CPU (float32, the golden file's
    arithmetic) and, for the few cases written for a smaller budget, that budget."""
    max_length: int = request.param
    budget = () if max_length == DEFAULT_MAX_LENGTH else ("--max-length", str(max_length))
    with Serve(real_worker=True, startup_wait=240, max_batch=None,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu", *budget)) as serve:
        yield serve, [case for case in CASES if case["max_length"] == max_length]


def _check(serve: Serve, case: dict[str, Any]) -> None:
    response = serve.post(json.dumps(case["request"], ensure_ascii=False).encode())
    if "error" in case:
        assert (response.status, response.detail) == (422, case["error"]["message"]), case["name"]
        return
    assert response.status == 200, (case["name"], response.body)
    assert response.header("Server-Timing") is not None, case["name"]
    assert_response_matches(response.json(), case["response"])


def test_every_case_again_and_in_reverse_order(
        served: tuple[Serve, list[dict[str, Any]]]) -> None:
    serve, cases = served
    assert cases
    for case in [*cases, *cases, *reversed(cases)]:
        _check(serve, case)
    answered = sum("error" not in case for case in cases)
    # Each answered case's two repeats came from the cache (refusals are never kept: the
    # front's own come before the lookup, the worker's token-budget one is a miss each time).
    assert metric(serve, "clef_answer_cache_total", result="hit") == answered * 2
    assert metric(serve, "clef_answer_cache_total", result="coalesced") == 0


def test_the_reordered_pair_is_two_requests() -> None:
    """The pair the answer cache once confused: the same questions in another order."""
    by_name = {case["name"]: case for case in CASES}
    first, second = by_name["invoice"], by_name["invoice_reordered"]
    assert list(first["request"]["questions"]) == list(reversed(second["request"]["questions"]))
    assert first["max_length"] == second["max_length"] == DEFAULT_MAX_LENGTH
    assert list(first["response"]["answers"]) != list(second["response"]["answers"])

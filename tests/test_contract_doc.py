"""docs/http-contract.md's table of `POST /v1/systemone` checks is what a running server does: the
rows are numbered 1 to 14, each row the test can trigger on its own gets the row's status and
detail, and a request that fails two rows is answered by the earlier one ("The first check that
fails answers"). The doc is read as the expectation, so a row edited out of step with the code
(its status, its detail, or its place in the order) fails here.

Rows 6 (a stalled body, a timeout), 7 (a client closing mid-body: nobody reads the answer) and 14
(a full queue) need timing or a held worker; tests/test_frontend_contract.py drives them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import REPO
from tests.frontend_helpers import Serve, clef_body

CONTRACT = REPO / "docs" / "http-contract.md"
BODY_LIMIT = 8 * 1024 * 1024  # the default --body-limit the doc's row 4 states


@dataclass(frozen=True)
class Row:
    number: int
    status: int
    detail: str | None  # the fixed detail text; None where the doc describes it in words


def documented_rows() -> dict[int, Row]:
    """The numbered rows of the checks table: `| # | when | status | detail |`."""
    rows = {}
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and cells[0].isdigit() and cells[2].isdigit():
            texts = re.findall(r"`([^`]+)`", cells[3])
            detail = texts[0] if cells[3].startswith("`") and len(texts) == 1 else None
            rows[int(cells[0])] = Row(int(cells[0]), int(cells[2]), detail)
    return rows


def test_the_rows_are_numbered_1_to_14_in_order() -> None:
    assert list(documented_rows()) == list(range(1, 15))


JSON = "Content-Type: application/json"


def head(*lines: str) -> bytes:
    return ("\r\n".join(["POST /v1/systemone HTTP/1.1", "Host: test", *lines])
            + "\r\n\r\n").encode("latin-1")


def with_body(body: bytes, *lines: str) -> bytes:
    return head(*lines, f"Content-Length: {len(body)}") + body


# One request per row that fails that row alone (every earlier check passes).
TRIGGERS: dict[int, bytes] = {
    1: head(JSON, "Transfer-Encoding: chunked"),
    2: head(JSON),
    3: head(JSON, "Content-Length: abc"),
    4: head(JSON, f"Content-Length: {BODY_LIMIT + 1}"),
    5: with_body(b"{}", "Content-Type: text/plain"),
    8: with_body(b"{\"a\": \"\\ud800\"}", JSON),
    9: with_body(b"[]", JSON),
    10: with_body(b"{\"a\": 1, \"a\": 2}", JSON),
    11: with_body(b"{\"a\": NaN}", JSON),
    12: with_body(b"{\"model\": \"m\"}", JSON),
    13: with_body(clef_body(error="device lost", error_status=500), JSON),
}

# Requests that fail two rows at once: the earlier row answers.
BOTH: dict[tuple[int, int], bytes] = {
    (1, 2): head(JSON, "Transfer-Encoding: chunked", "Content-Length: 1", "Content-Length: 2"),
    (1, 3): head(JSON, "Transfer-Encoding: chunked", "Content-Length: abc"),
    (1, 5): head("Content-Type: text/plain", "Transfer-Encoding: chunked"),
    (2, 5): head("Content-Type: text/plain", "Content-Length: 1", "Content-Length: 2"),
    (3, 5): head("Content-Type: text/plain", "Content-Length: -1"),
    (4, 5): head("Content-Type: text/plain", f"Content-Length: {BODY_LIMIT + 1}"),
    (5, 8): with_body(b"\xff", "Content-Type: text/plain"),
    (5, 12): with_body(b"{\"model\": \"m\"}", "Content-Type: text/plain"),
    (8, 9): with_body(b"[\"\\ud800\"]", JSON),
    (8, 10): with_body(b"{\"a\": \"\\ud800\", \"a\": 1}", JSON),
    (8, 11): with_body(b"{\"a\": \"\\ud800\", \"b\": NaN}", JSON),
    (8, 12): with_body(b"{\"model\": \"\xff\"}", JSON),
    (9, 10): with_body(b"[{\"a\": 1, \"a\": 2}]", JSON),
    (9, 11): with_body(b"[NaN]", JSON),
    (10, 11): with_body(b"{\"a\": NaN, \"a\": 1}", JSON),
    (9, 12): with_body(b"[{\"model\": \"m\"}]", JSON),
    (10, 12): with_body(b"{\"model\": \"m\", \"model\": \"m\"}", JSON),
    (11, 12): with_body(b"{\"model\": \"m\", \"state\": Infinity}", JSON),
}


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve() as server:  # production defaults: the doc states them (body limit 8 MiB)
        yield server


def answer(serve: Serve, raw: bytes) -> tuple[int, str]:
    with serve.connect() as client:
        client.send_raw(raw)
        response = client.read_response()
        return response.status, response.detail


@pytest.mark.parametrize("number", sorted(TRIGGERS))
def test_each_row_answers_with_its_status_and_detail(serve: Serve, number: int) -> None:
    row = documented_rows()[number]
    status, detail = answer(serve, TRIGGERS[number])
    assert status == row.status, f"row {number}: the doc says {row.status}, the server {status}"
    if row.detail is not None:
        assert detail == row.detail
    else:  # row 12: the validation message, the reference's own for a missing state
        assert detail == "model and state are required"


@pytest.mark.parametrize(("first", "later"), sorted(BOTH))
def test_the_earlier_row_answers_when_two_fail(serve: Serve, first: int, later: int) -> None:
    rows = documented_rows()
    status, detail = answer(serve, BOTH[first, later])
    assert (status, detail) != (rows[later].status, rows[later].detail)
    assert status == rows[first].status
    if rows[first].detail is not None:
        assert detail == rows[first].detail


def test_the_order_pairs_span_the_table() -> None:
    """Every row the test triggers is ordered against a later one, so a row moved in the doc
    (or a check moved in the code) breaks at least one pair."""
    ordered = {number for pair in BOTH for number in pair}
    assert set(TRIGGERS) - {13} <= ordered


def test_the_doc_s_json_details_are_sent_as_json(serve: Serve) -> None:
    """A detail is the body's only key, a JSON string (what the table's details are)."""
    with serve.connect() as client:
        client.send_raw(TRIGGERS[9])
        assert json.loads(client.read_response().body) == {"detail": documented_rows()[9].detail}

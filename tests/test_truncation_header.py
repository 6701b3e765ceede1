"""X-Clef-State-Truncated from the real worker on the tiny snapshot: a state cut to fit
`--max-length` reports exactly the tokens dropped; a state that fits has no header."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Response, Serve

MAX_LENGTH = 1024
STATE = "word " * 3000 + "the end"
RUN = "/accounts/a/ai/run/@cf/cloudflare/clef-flash"


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(real_worker=True, startup_wait=240,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                           "--max-length", str(MAX_LENGTH))) as server:
        yield server


def request(state: str) -> bytes:
    return json.dumps({"model": "m", "state": state,
                       "questions": {"long": {"type": "noul"}}}).encode()


def body_of(response: Response, path: str) -> Any:
    document = response.json()
    return document["result"] if path == RUN else document


@pytest.mark.parametrize("path", ["/v1/systemone", RUN])
def test_cut_state_reports_the_tokens_dropped(serve: Serve, path: str) -> None:
    empty = serve.request("POST", path, request(""))
    assert empty.status == 200 and empty.header("X-Clef-State-Truncated") is None
    fixed = body_of(empty, path)["usage"]["input_tokens"]  # everything but the state

    response = serve.request("POST", path, request(STATE))
    assert response.status == 200
    assert body_of(response, path)["usage"]["input_tokens"] == MAX_LENGTH
    tokenizer = Tokenizer.from_file(str(TINY_SNAPSHOT / "tokenizer.json"))
    whole = len(tokenizer.encode(STATE, add_special_tokens=False).ids)
    assert response.header("X-Clef-State-Truncated") == str(whole - (MAX_LENGTH - fixed))


def test_a_state_that_fits_has_no_header(serve: Serve) -> None:
    response = serve.request("POST", "/v1/systemone", request("short"))
    assert response.status == 200
    assert response.header("X-Clef-State-Truncated") is None

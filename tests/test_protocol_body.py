"""Body parsing: docs/http-contract.md rows 8-11, in order, with their exact details."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clef_protocol.body import (
    DUPLICATE_KEYS,
    INVALID_JSON,
    MAX_DEPTH,
    NON_FINITE,
    NOT_AN_OBJECT,
    parse_body,
)
from clef_protocol.errors import BadRequestBody


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"", INVALID_JSON),
        (b"{", INVALID_JSON),
        (b"\xff\xfe{}", INVALID_JSON),  # not UTF-8
        (b'{"a": "\xe9"}', INVALID_JSON),  # Latin-1 byte inside a string
        (b'{"a": "\\ud800"}', INVALID_JSON),  # lone high surrogate
        (b'{"\\udc00": 1}', INVALID_JSON),  # lone surrogate in a key
        (b'{"a": 1e999}', INVALID_JSON),  # overflows to infinity
        (b'{"a": -1E400}', INVALID_JSON),
        (b'{"n": ' + b"9" * 5000 + b"}", INVALID_JSON),  # past Python's integer digit limit
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), INVALID_JSON),
        (b'{"a":' * 100000 + b"1" + b"}" * 100000, INVALID_JSON),  # past the recursion limit
        (b"[]", NOT_AN_OBJECT),
        (b"null", NOT_AN_OBJECT),
        (b"3", NOT_AN_OBJECT),
        (b'"{}"', NOT_AN_OBJECT),
        (b'[1, 1e999]', INVALID_JSON),  # row 8 before row 9
        (b"NaN", NOT_AN_OBJECT),  # row 9 before row 11
        (b'{"a": 1, "a": 1}', DUPLICATE_KEYS),
        (b'{"q": {"x": [{"k": 1, "k": 2}]}}', DUPLICATE_KEYS),  # at any depth
        (b'{"a": NaN, "b": 1, "b": 2}', DUPLICATE_KEYS),  # row 10 before row 11
        (b'{"a": NaN}', NON_FINITE),
        (b'{"a": [Infinity]}', NON_FINITE),
        (b'{"a": {"b": -Infinity}}', NON_FINITE),
    ],
)
def test_refusals(body: bytes, detail: str) -> None:
    with pytest.raises(BadRequestBody) as excinfo:
        parse_body(body)
    assert str(excinfo.value) == detail


def test_accepts_what_json_allows() -> None:
    body = (
        '{"a": "\\ud83d\\ude00 é", "big": 123456789012345678901234567890, '
        '"z": -0.0, "t": 1e-400}'
    )
    assert parse_body(body.encode()) == {
        "a": "😀 é", "big": 123456789012345678901234567890, "z": -0.0, "t": 0.0,
    }


def test_nesting_at_the_limit_is_accepted() -> None:
    body = b'{"a":' + b"[" * (MAX_DEPTH - 1) + b"1" + b"]" * (MAX_DEPTH - 1) + b"}"
    assert isinstance(parse_body(body), dict)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=25,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_any_json_object_round_trips(document: dict) -> None:
    assert parse_body(json.dumps(document, ensure_ascii=False).encode()) == document

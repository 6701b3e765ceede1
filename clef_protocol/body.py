"""Parsing a `/v1/systemone` body into a JSON object (docs/http-contract.md rows 8-11 -> 400).

Python's `json` accepts things the contract refuses (duplicate keys keep the last value, `NaN`
literals, `1e999` becomes infinity, `"\\ud800"` becomes a lone surrogate, deep nesting only fails
at the interpreter's recursion limit), so the parse records what it meets and the checks are
applied afterwards in contract order: the first failing row wins.
"""

from __future__ import annotations

import json
import math
from typing import Any

from clef_protocol.errors import BadRequestBody

INVALID_JSON = "request body must contain valid JSON and UTF-8 text"
NOT_AN_OBJECT = "request must be a JSON object"
DUPLICATE_KEYS = "duplicate JSON keys are not supported"
NON_FINITE = "non-finite JSON numbers are not supported"

# Deeper documents are refused as row 8 ("nests too deep"). The bound keeps every later
# recursive step (json.dumps when the worker renders a value) far from Python's recursion limit.
MAX_DEPTH = 256


class _Overflow(Exception):
    """A number literal that only fits as infinity."""


class _ParseNotes:
    """What the parse hooks saw; checked after parsing, in contract order."""

    def __init__(self) -> None:
        self.duplicate_keys = False
        self.non_finite = False
        # The values a repeated key replaced: gone from the document, but row 8 (a lone
        # surrogate, too deep) comes before row 10 (the repeat) and must still see them.
        self.replaced: list[Any] = []

    def object_pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            self.duplicate_keys = True
            kept = {id(value) for value in obj.values()}
            self.replaced += [value for _, value in pairs if id(value) not in kept]
        return obj

    def constant(self, name: str) -> float:
        self.non_finite = True
        return math.nan

    @staticmethod
    def number(text: str) -> float:
        value = float(text)
        if math.isinf(value):
            raise _Overflow(text)
        return value


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep_or_surrogate(root: Any) -> bool:
    """Walk the document without recursion: any lone surrogate, or nesting past MAX_DEPTH."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return True
        elif isinstance(value, dict):
            if depth > MAX_DEPTH:
                return True
            for key, item in value.items():
                if _has_surrogate(key):
                    return True
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            if depth > MAX_DEPTH:
                return True
            stack.extend((item, depth + 1) for item in value)
    return False


def _may_be_deep_or_surrogate(body: bytes) -> bool:
    """Whether the document needs the walk at all, judged from its bytes in C: valid UTF-8
    holds no surrogate, so a lone one can only come from a `\\u` escape; and a document with
    at most MAX_DEPTH brackets cannot nest deeper (brackets inside strings only make the
    answer more cautious). Most requests have neither, and skip the walk."""
    return b"\\u" in body or body.count(b"{") + body.count(b"[") > MAX_DEPTH


def parse_body(body: bytes) -> dict[str, Any]:
    """Decode a request body, or raise BadRequestBody with the contract's detail."""
    notes = _ParseNotes()
    try:
        text = body.decode("utf-8")
        document = json.loads(
            text,
            object_pairs_hook=notes.object_pairs,
            parse_constant=notes.constant,
            parse_float=notes.number,
        )
    except (UnicodeDecodeError, ValueError, RecursionError, _Overflow):
        # ValueError covers JSONDecodeError and integers past Python's digit limit.
        raise BadRequestBody(INVALID_JSON) from None
    if _may_be_deep_or_surrogate(body) and any(
            _too_deep_or_surrogate(value) for value in (document, *notes.replaced)):
        raise BadRequestBody(INVALID_JSON)
    if not isinstance(document, dict):
        raise BadRequestBody(NOT_AN_OBJECT)
    if notes.duplicate_keys:
        raise BadRequestBody(DUPLICATE_KEYS)
    if notes.non_finite:
        raise BadRequestBody(NON_FINITE)
    return document

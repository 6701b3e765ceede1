"""Parsing a `/v1/systemone` body into a JSON object (contract rows 8-11 -> 400).

(being written; interface fixed)
"""

from __future__ import annotations

from typing import Any


class BadRequestBody(ValueError):
    """The body is not an acceptable JSON object; str(exc) is the 400 detail."""


def parse_body(body: bytes) -> dict[str, Any]:
    """Decode UTF-8 JSON, refusing duplicate keys, non-finite numbers, lone surrogates, deep nesting."""
    raise NotImplementedError

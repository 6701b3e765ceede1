"""Request validation (contract row 12 -> 422), shared by the front and the worker.

(being written; interface fixed)
"""

from __future__ import annotations

from typing import Any

from clef_protocol.options import RequestLimits


class RequestInvalid(ValueError):
    """The request is well-formed JSON but cannot be answered; str(exc) is the 422 detail."""


def validate_request(request: dict[str, Any], limits: RequestLimits) -> None:
    """Raise RequestInvalid with the first failing rule's message."""
    raise NotImplementedError

"""Routing and the ordered checks of docs/http-contract.md, as pure functions.

The connection does the I/O (reading the body, rows 6-7, and waiting for the worker); every
decision that needs no I/O lives here, in contract order, so the table and the code can be read
side by side. Each check returns either the value the next step needs or the `Reply` that ends
the request (first failure wins).
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

from clef_frontend import responses, workers_ai
from clef_frontend.framing import FramingHeaders
from clef_frontend.responses import Reply
from clef_protocol.body import parse_body
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request


class Route(Enum):
    """Each route's path and the one method it answers: the route table itself."""

    HEALTH = (b"/health", b"GET")
    SYSTEMONE = (b"/v1/systemone", b"POST")
    MODELS = (b"/v1/models", b"GET")
    WORKERS_AI = (workers_ai.PATH_TEMPLATE.encode("ascii"), b"POST")  # a pattern, not a path
    METRICS = (b"/metrics", b"GET")

    def __init__(self, path: bytes, method: bytes) -> None:
        self.path = path
        self.method = method

    @property
    def is_scoring(self) -> bool:
        """Whether requests on this route are scored by a worker (and measured as such)."""
        return self in _SCORING


_SCORING = frozenset({Route.SYSTEMONE, Route.WORKERS_AI})


# Targets are compared as sent: `/health?x=1` is unknown.
_BY_PATH: dict[bytes, Route] = {known.path: known for known in Route
                                 if known is not Route.WORKERS_AI}

_DECIMAL = re.compile(rb"[0-9]+")
_MEDIA_TYPE = "application/json"


def route(method: bytes, target: bytes) -> Route | Reply:
    """The route table: 404 for unknown targets, 405 with `Allow` for the wrong method."""
    found = _BY_PATH.get(target)
    if found is None and workers_ai.run_target(target) is not None:
        found = Route.WORKERS_AI
    if found is None:
        return responses.error(404, "unknown route")
    if method != found.method:
        return responses.error(405, "method not allowed", allow=found.method.decode("ascii"))
    return found


def check_post_head(
    framing: FramingHeaders, content_type: bytes | None, body_limit: int
) -> int | Reply:
    """Rows 1-5: the body length to read, or the refusal (the body is then never read)."""
    if framing.transfer_encodings:
        return responses.error(
            411, "Content-Length is required; chunked requests are unsupported", close=True
        )
    if len(framing.content_lengths) != 1:
        return responses.error(411, "one Content-Length is required", close=True)
    raw = framing.content_lengths[0]
    if not _DECIMAL.fullmatch(raw):
        return responses.error(400, "invalid Content-Length", close=True)
    # Compare digit counts first: int() of a huge digit string is slow or refused outright.
    digits = raw.lstrip(b"0") or b"0"
    if len(digits) > len(str(body_limit)) or int(digits) > body_limit:
        return responses.error(413, "request exceeds body limit", close=True)
    if media_type(content_type) != _MEDIA_TYPE:
        return responses.error(415, "Content-Type must be application/json", close=True)
    return int(digits)


def media_type(content_type: bytes | None) -> str | None:
    """`Application/JSON; charset=utf-8` -> `application/json`; None when absent."""
    if content_type is None:
        return None
    return content_type.split(b";", 1)[0].strip(b" \t").decode("latin-1").lower()


def check_body(body: bytes, limits: RequestLimits) -> Reply | dict[str, Any]:
    """Rows 8-12: the parsed request when it may join the queue, else its 400 or 422 (the
    parsed request is kept, so nothing after validation parses the body again)."""
    try:
        request = parse_body(body)
    except BadRequestBody as exc:
        return responses.error(400, str(exc))
    try:
        validate_request(request, limits)
    except RequestInvalid as exc:
        return responses.error(422, str(exc))
    return request

"""The checks of a scoring request, in the order of docs/http-contract.md, as pure functions.

Both drivers run them: `clef-serve`'s pipeline one stage at a time (its own steps, the key and
the quota, come between them, and the body is read between the head's checks and the body's),
`clef-batch` all at once for each input line (`RequestRules.check`). One module, one order: a
refusal added here reaches both, with the same status and `detail`. Each check returns the value
the next stage needs or the `Reply` that ends the request (the first failure wins).

    target (Workers-AI model, 404) -> head (rows 1-5: 411, 400, 413, 415) -> body (rows 8-12:
    400 malformed JSON, 422 invalid request)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from clef_api import responses, workers_ai
from clef_api.catalogue import Catalogue
from clef_api.framing import FramingHeaders
from clef_api.responses import Reply
from clef_protocol.body import parse_body
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request

# The largest body accepted (413 above it, `--body-limit`).
DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
JSON_MEDIA_TYPE = "application/json"
_DECIMAL = re.compile(rb"[0-9]+")


def check_target(target: bytes, catalogue: Catalogue) -> Reply | None:
    """The Workers-AI route's model name: None if the path names a model served (or is not a
    Workers-AI path), else its 404."""
    run = workers_ai.run_target(target)
    return workers_ai.check_model(run, catalogue) if run is not None else None


def check_head(
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
    if media_type(content_type) != JSON_MEDIA_TYPE:
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


@dataclass(frozen=True)
class RequestRules:
    """What the checks consult: the request limits, the names served and the body limit."""

    limits: RequestLimits
    catalogue: Catalogue
    body_limit: int = DEFAULT_BODY_LIMIT

    def check(self, target: bytes, framing: FramingHeaders, content_type: bytes | None,
              body: bytes) -> dict[str, Any] | Reply:
        """Every check of a scoring request at once, in contract order: the parsed, valid
        request, or the first refusal."""
        refused = check_target(target, self.catalogue)
        if refused is not None:
            return refused
        length = check_head(framing, content_type, self.body_limit)
        if isinstance(length, Reply):
            return length
        checked = check_body(body, self.limits)
        if isinstance(checked, Reply):
            return checked
        # With fine-tuned variants served, the body's model must be one this server serves.
        return self.catalogue.check_body_model(checked.get("model"),
                                               workers_ai.path_model(target)) or checked

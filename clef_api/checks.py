"""The checks of a scoring request, in the order of docs/http-contract.md: `RequestRules`.

Both drivers run them through `RequestRules`' stage methods, and only through them: `clef-serve`'s
pipeline one stage at a time (its own steps, the key and the quota, come between the target and
the head, and the body is read between the head and the body, so a refused head costs no
upload), `clef-batch` all at once for each input line (`RequestRules.check`, which calls the same
stages in the same order). One class, one order: a refusal added to a stage reaches both, with
the same status and `detail`. Each stage returns the value the next one needs or the `Reply`
that ends the request (the first failure wins).

    check_target (Workers-AI model, 404) -> check_head (rows 1-5: 411, 400, 413, 415)
    -> check_body (rows 8-12: 400 malformed JSON, 422 invalid request; with variants served,
    the body's model: 404, 422)
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


def media_type(content_type: bytes | None) -> str | None:
    """`Application/JSON; charset=utf-8` -> `application/json`; None when absent."""
    if content_type is None:
        return None
    return content_type.split(b";", 1)[0].strip(b" \t").decode("latin-1").lower()


@dataclass(frozen=True)
class RequestRules:
    """What the checks consult (the request limits, the names served, the body limit) and the
    checks themselves, as stages; built once per server or run, not per request."""

    limits: RequestLimits
    catalogue: Catalogue
    body_limit: int = DEFAULT_BODY_LIMIT

    def check_target(self, target: bytes) -> Reply | None:
        """The Workers-AI route's model name: None if the path names a model served (or is not
        a Workers-AI path), else its 404."""
        run = workers_ai.run_target(target)
        return workers_ai.check_model(run, self.catalogue) if run is not None else None

    def check_head(self, framing: FramingHeaders, content_type: bytes | None) -> int | Reply:
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
        if len(digits) > len(str(self.body_limit)) or int(digits) > self.body_limit:
            return responses.error(413, "request exceeds body limit", close=True)
        if media_type(content_type) != JSON_MEDIA_TYPE:
            return responses.error(415, "Content-Type must be application/json", close=True)
        return int(digits)

    def check_body(self, target: bytes, body: bytes) -> dict[str, Any] | Reply:
        """Rows 8-12, then the body's `model` against the variants served: the parsed request
        when it may join the queue, else its 400, 404 or 422 (the parsed request is kept, so
        nothing after validation parses the body again)."""
        try:
            request = parse_body(body)
        except BadRequestBody as exc:
            return responses.error(400, str(exc))
        try:
            validate_request(request, self.limits)
        except RequestInvalid as exc:
            return responses.error(422, str(exc))
        if not self.catalogue.chooses_model:  # any name is accepted: skip the path's parse
            return request
        # With fine-tuned variants served, the body's model must be one this server serves.
        return self.catalogue.check_body_model(request.get("model"),
                                               workers_ai.path_model(target)) or request

    def check(self, target: bytes, framing: FramingHeaders, content_type: bytes | None,
              body: bytes) -> dict[str, Any] | Reply:
        """Every stage at once, in contract order: the parsed, valid request, or the first
        refusal (what `clef-batch` asks of each line)."""
        refused = self.check_target(target)
        if refused is not None:
            return refused
        length = self.check_head(framing, content_type)
        if isinstance(length, Reply):
            return length
        return self.check_body(target, body)

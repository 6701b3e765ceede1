"""What goes back on the wire: a status, a JSON body and the few headers the contract requires.

Every error body is built here and only here, serialised exactly as docs/http-contract.md says
(`json.dumps({"detail": d}, ensure_ascii=False, allow_nan=False)`, default separators), so the
operators' clients keep seeing the same bytes as from the server they replace.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from clef_api.truncation import truncation_headers
from clef_dispatch import Answer, Outcome, RefusalKind
from clef_protocol.messages import INFERENCE_FAILED, WorkerReply

JSON = "application/json"
# Every scored answer names the weights that made it, as OpenAI's `system_fingerprint` lets
# clients notice a model change: the first WEIGHTS_DIGITS hex digits of the fingerprint of the
# model that scored it (clef_protocol.messages.ReadyInfo.models), also for an answer served
# from memory or shared with an identical request (the kept answer's own weights).
WEIGHTS_HEADER = "Clef-Weights"
WEIGHTS_DIGITS = 16


def short_weights(fingerprint: str) -> str:
    """The short digest of a weights fingerprint (the header's value and the access log's)."""
    return fingerprint[:WEIGHTS_DIGITS]

log = logging.getLogger("clef_api.responses")


@dataclass(frozen=True)
class Reply:
    """One HTTP response before h11 frames it.

    `close` asks for `Connection: close` (the request body was not fully read, or the server is
    draining); `retry_after` adds `Retry-After` to a 503. `detail` is the text of an error body
    (so another body shape, the Workers-AI envelope, can carry it); `extra_headers` are added
    as given (`WWW-Authenticate`, `X-Clef-State-Truncated`).
    """

    status: int
    body: bytes
    retry_after: int | None = None
    close: bool = False
    allow: str | None = None
    detail: str | None = None
    extra_headers: tuple[tuple[str, str], ...] = ()
    content_type: str = JSON

    def headers(self, *, close: bool) -> list[tuple[str, str]]:
        """Response headers; Content-Length always, since h11 would otherwise chunk or close."""
        headers = [("Content-Type", self.content_type), ("Content-Length", str(len(self.body)))]
        if self.allow is not None:
            headers.append(("Allow", self.allow))
        if self.retry_after is not None:
            headers.append(("Retry-After", str(self.retry_after)))
        headers.extend(self.extra_headers)
        if close or self.close:
            headers.append(("Connection", "close"))
        return headers


def json_bytes(value: Any) -> bytes:
    """The contract's serialisation: UTF-8, non-ASCII kept, default separators, no NaN."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


def error(
    status: int,
    detail: str,
    *,
    close: bool = False,
    retry_after: int | None = None,
    allow: str | None = None,
    extra_headers: tuple[tuple[str, str], ...] = (),
) -> Reply:
    """`{"detail": ...}` with the given status."""
    return Reply(status, json_bytes({"detail": detail}), retry_after=retry_after, close=close,
                 allow=allow, detail=detail, extra_headers=extra_headers)


def unavailable(detail: str, retry_after: int) -> Reply:
    """Contract row 14: a 503 that tells the client when to come back."""
    return error(503, detail, retry_after=retry_after)


def from_worker(answer: WorkerReply) -> Reply:
    """A worker answer as HTTP: the body byte for byte, or `{"detail": ...}`.

    A 5xx never carries the worker's text: the cause belongs in the log, and the contract's
    detail is `inference failed`.
    """
    if answer.body is not None:
        weights = ((WEIGHTS_HEADER, short_weights(answer.weights)),) if answer.weights else ()
        return Reply(answer.status, answer.body,
                     extra_headers=truncation_headers(answer.truncated_tokens) + weights)
    detail = answer.detail or ""
    if answer.status >= 500:
        if detail != INFERENCE_FAILED:
            log.error("worker answered %d: %s", answer.status, detail)
        detail = INFERENCE_FAILED
    return error(answer.status, detail)


# The status the HTTP API gives each kind of refusal (docs/http-contract.md rows 13-14, deadlines).
REFUSAL_STATUS = {RefusalKind.UNAVAILABLE: 503, RefusalKind.EXPIRED: 504, RefusalKind.FAILED: 500,
                  RefusalKind.UNKNOWN_MODEL: 404}


def from_outcome(outcome: Outcome) -> Reply:
    """A dispatch outcome as the HTTP API answers it: the worker's reply, or the refusal's
    status with its detail (and `Retry-After` when it says when)."""
    if isinstance(outcome, Answer):
        return from_worker(outcome.reply)
    return error(REFUSAL_STATUS[outcome.kind], outcome.detail, retry_after=outcome.retry_after)


def document(status: int, value: dict[str, Any], *, retry_after: int | None = None) -> Reply:
    """A JSON object built by the front itself (the `/health` answer)."""
    return Reply(status, json_bytes(value), retry_after=retry_after)

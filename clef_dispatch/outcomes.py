"""What a submitted request comes to: a worker's answer, or a refusal.

These are the dispatch package's own words, free of HTTP: each driver maps them to what it
writes (`clef_api.responses.from_outcome` gives the HTTP API's reply, which the front sends
and clef-batch records). A refusal's kind names why nothing (or nothing usable) came back:

- `UNAVAILABLE`: not queued, or dropped from the queue: no warm worker, the queue is full, the
  server drains (the caller may retry after `retry_after` seconds);
- `EXPIRED`: the request's deadline passed before a worker took it (or, for a request sharing
  another's forward, before a worker took that one);
- `FAILED`: the request was sent, and sent again alone, and its worker was lost both times
  (the API's 500 `inference failed`);
- `UNKNOWN_MODEL`: no worker serves the model it names any more, ready or restarting (its
  checkpoint was removed while the request waited, or while it was on a worker that was lost):
  the API's 404, naming the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from clef_protocol.messages import WorkerReply


class RefusalKind(Enum):
    UNAVAILABLE = "unavailable"
    EXPIRED = "expired"
    FAILED = "failed"
    UNKNOWN_MODEL = "unknown_model"


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's reply to the request: its answer (`reply.body`) or its refusal of the input
    (`reply.detail`: the 422 the worker found, or its own 500)."""

    reply: WorkerReply

    @property
    def ok(self) -> bool:
        """A scored answer: the only outcome that may be kept or shared with later requests."""
        return self.reply.body is not None and self.reply.status == 200


@dataclass(frozen=True, slots=True)
class Refusal:
    """No answer: why (`kind`), the detail for the caller, and when to retry (None: not
    said)."""

    kind: RefusalKind
    detail: str
    retry_after: int | None = None


Outcome = Answer | Refusal

EXPIRED_DETAIL = "deadline passed before a worker was free"
SHARED_EXPIRED_DETAIL = "deadline passed before the shared answer came"

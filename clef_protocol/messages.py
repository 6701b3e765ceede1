"""Message kinds exchanged over the frame channel, and constructors that fix their fields.

Worker -> front: `ready` (once, after warm-up), `fatal` (could not start), `response` and `error`
(one per request). Front -> worker: `request`, `shutdown`. Request ids are chosen by the front and
echoed by the worker, so a reply can never be matched to the wrong request.
"""

from __future__ import annotations

from typing import Any

READY = "ready"
FATAL = "fatal"
REQUEST = "request"
RESPONSE = "response"
ERROR = "error"
SHUTDOWN = "shutdown"

WORKER_KINDS = frozenset({READY, FATAL, RESPONSE, ERROR})
FRONT_KINDS = frozenset({REQUEST, SHUTDOWN})


def ready(
    *,
    pid: int,
    thread: str,
    model: str,
    variant: str,
    device: str,
    dtype: str,
    gdn_path: str,
    warmup_ms: float,
    versions: dict[str, str],
    demo: bool = False,
    snapshot: str = "",
) -> dict[str, Any]:
    """The worker is loaded and its warm-up forward has returned: the front may bind its port."""
    return {
        "kind": READY,
        "pid": pid,
        "thread": thread,
        "model": model,
        "variant": variant,
        "device": device,
        "dtype": dtype,
        "gdn_path": gdn_path,
        "warmup_ms": warmup_ms,
        "versions": versions,
        "demo": demo,
        "snapshot": snapshot,
    }


def fatal(reason: str) -> dict[str, Any]:
    """The worker cannot start; `reason` is shown to the operator verbatim."""
    return {"kind": FATAL, "reason": reason}


def request(request_id: int, body: bytes) -> dict[str, Any]:
    """One admitted `/v1/systemone` body, as the client sent it."""
    return {"kind": REQUEST, "id": request_id, "body": body}


def response(request_id: int, body: bytes, worker_ms: float, status: int = 200) -> dict[str, Any]:
    """A successful answer: `body` is the final JSON, forwarded to the client unchanged."""
    return {"kind": RESPONSE, "id": request_id, "status": status, "body": body,
            "worker_ms": worker_ms}


def error(request_id: int, status: int, detail: str, worker_ms: float) -> dict[str, Any]:
    """A refused (422) or failed (500) request; the front turns `detail` into `{"detail": ...}`."""
    return {"kind": ERROR, "id": request_id, "status": status, "detail": detail,
            "worker_ms": worker_ms}


def shutdown() -> dict[str, Any]:
    """Finish the current request (if any) and exit 0."""
    return {"kind": SHUTDOWN}

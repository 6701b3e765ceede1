"""Log set-up and the one-line-per-request access log, all on stderr.

Lines are `key=value` so they can be grepped and parsed; request bodies never appear (they are
client data, can be megabytes, and may be confidential). The worker inherits our stderr, so its
own lines interleave with these, each line whole.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s clef-serve[%(process)d] %(levelname)s %(message)s"
_TARGET_CHARS = 200

access = logging.getLogger("clef_frontend.access")


def configure(level: str = "INFO") -> None:
    """Route every `clef_frontend.*` logger to stderr with one format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger("clef_frontend")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def printable(raw: bytes) -> str:
    """A request target as a safe log token: ASCII, escaped, bounded."""
    text = raw[:_TARGET_CHARS].decode("ascii", "backslashreplace")
    return text + ("..." if len(raw) > _TARGET_CHARS else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def request_line(
    *,
    method: bytes,
    target: bytes,
    status: int,
    queue_ms: float | None,
    worker_ms: float | None,
    bytes_in: int,
    bytes_out: int,
    client: str,
    request_id: str = "-",
) -> None:
    """`request method=POST path=/v1/systemone status=200 queue_ms=0.3 worker_ms=41.2 ...`"""
    access.info(
        "request method=%s path=%s status=%d queue_ms=%s worker_ms=%s bytes_in=%d bytes_out=%d "
        "client=%s request_id=%s",
        printable(method), printable(target), status, _ms(queue_ms), _ms(worker_ms), bytes_in,
        bytes_out, client, request_id,
    )

"""`X-Clef-State-Truncated`: tell the client its state was cut to fit `--max-length`.

The body stays the reference's body byte for byte, so the only place the cut can show is a
header. Its value is the number of state tokens the worker dropped (from the `response` frame's
`truncated_tokens`); the header is absent when nothing was dropped.
"""

from __future__ import annotations

from clef_frontend.worker_channel import WorkerReply

HEADER = "X-Clef-State-Truncated"


def truncation_headers(reply: WorkerReply) -> tuple[tuple[str, str], ...]:
    """The header for a reply whose state was cut, else nothing."""
    if reply.truncated_tokens > 0:
        return ((HEADER, str(reply.truncated_tokens)),)
    return ()

"""`X-Clef-State-Truncated`: tell the client its state was cut to fit `--max-length`.

The body stays the reference's body byte for byte, so the only place the cut can show is a
header. Its value is the number of state tokens the worker dropped (the `response` frame's
`truncated_tokens`); the header is absent when nothing was dropped.
"""

from __future__ import annotations

HEADER = "X-Clef-State-Truncated"


def truncation_headers(truncated_tokens: int) -> tuple[tuple[str, str], ...]:
    """The header for an answer whose state was cut, else nothing."""
    if truncated_tokens > 0:
        return ((HEADER, str(truncated_tokens)),)
    return ()

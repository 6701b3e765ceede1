"""The raw body-framing headers of a request head, for contract rows 1-4.

Why not read them from h11's Request event: h11 normalises exactly these two headers before we
see them. It merges repeated equal `Content-Length` lines into one (row 2 wants 411 for two
lines), accepts `Transfer-Encoding: chunked` (row 1 wants 411), and refuses `abc`, `-1`, `+2`,
non-chunked codings and conflicting lengths with an exception raised before the method and target
are known (rows 1-3 want their own status and detail, and only on `POST /v1/systemone`). So the
connection keeps the raw bytes of each head, `scan_framing` lists these headers as sent, and
`reparse_without_framing` lets h11 parse a head it refused once the two framing headers are
removed, so routing still works and the contract, not h11, chooses the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import h11

TRANSFER_ENCODING = b"transfer-encoding"
CONTENT_LENGTH = b"content-length"
_FRAMING = (TRANSFER_ENCODING, CONTENT_LENGTH)
_OPTIONAL_WHITESPACE = b" \t"


@dataclass(frozen=True)
class FramingHeaders:
    """Every Transfer-Encoding and Content-Length value in the head, in order, unparsed."""

    transfer_encodings: tuple[bytes, ...]
    content_lengths: tuple[bytes, ...]


def _lines(raw_head: bytes) -> list[bytes]:
    """Split a head the way h11 does: LF ends a line, a CR before it is dropped."""
    return [line[:-1] if line.endswith(b"\r") else line for line in raw_head.split(b"\n")]


def _field_name(line: bytes) -> bytes:
    name, colon, _ = line.partition(b":")
    return name.lower() if colon else b""


_NO_FRAMING = FramingHeaders((), ())
_LENGTH_LINE = b"\n" + CONTENT_LENGTH + b":"


def scan_framing(raw_head: bytes) -> FramingHeaders:
    """List the framing headers of a head (request line first, blank line last).

    Most heads name neither header, or Content-Length once at the start of a line; those are
    read with a few searches in C, and every other head line by line."""
    lower = raw_head.lower()
    if TRANSFER_ENCODING not in lower:
        mentions = lower.count(CONTENT_LENGTH)
        if mentions == 0:
            return _NO_FRAMING
        start = lower.find(_LENGTH_LINE)
        if mentions == 1 and start >= 0:
            start += len(_LENGTH_LINE)
            end = raw_head.find(b"\n", start)
            value = raw_head[start:end if end >= 0 else len(raw_head)]
            if value.endswith(b"\r"):
                value = value[:-1]
            return FramingHeaders((), (value.strip(_OPTIONAL_WHITESPACE),))
    return _scan_lines(raw_head)


def _scan_lines(raw_head: bytes) -> FramingHeaders:
    encodings: list[bytes] = []
    lengths: list[bytes] = []
    for line in _lines(raw_head)[1:]:
        name = _field_name(line)
        value = line.partition(b":")[2].strip(_OPTIONAL_WHITESPACE)
        if name == TRANSFER_ENCODING:
            encodings.append(value)
        elif name == CONTENT_LENGTH:
            lengths.append(value)
    return FramingHeaders(tuple(encodings), tuple(lengths))


def reparse_without_framing(raw_head: bytes) -> tuple[h11.Connection, h11.Request] | None:
    """Parse a head h11 refused, minus its framing headers; None if nothing could be removed.

    The returned connection has consumed that head: the caller answers on it and closes, since
    the body's length is unknown. Heads with obsolete line folding are not rescued, because
    removing a line could glue its continuation onto another header. If the head is malformed
    apart from its framing (a missing or repeated Host, say), h11's RemoteProtocolError for that
    fault is raised: it is the one to report, not h11's first complaint about the framing (a 501
    for a coding other than chunked, which the contract never answers).
    """
    raw_lines = raw_head.split(b"\n")
    if any(line[:1] in (b" ", b"\t") for line in raw_lines[1:]):
        return None
    kept = [raw_lines[0]] + [line for line in raw_lines[1:] if _field_name(line) not in _FRAMING]
    if len(kept) == len(raw_lines):
        return None  # nothing to remove: h11's refusal had another cause
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"\n".join(kept))
    event = connection.next_event()
    if not isinstance(event, h11.Request):
        return None
    return connection, event

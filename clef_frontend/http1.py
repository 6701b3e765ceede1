"""HTTP/1.1 on one connection, free of I/O: bytes in, request events out; replies in, bytes out.

A thin layer over `h11.Connection`, in the shape of hypercorn's `protocol/h11.py`: the socket
and the timers live in `connection.py`, and this class never reads, writes, sleeps or knows the
time, so every framing decision can be tested by feeding it bytes.

What it adds to h11, and why:
- the raw bytes of each head are kept, because contract rows 1-3 judge framing headers as sent,
  which h11 normalises (see framing.py);
- a head h11 refuses only for its framing headers is rescued (parsed again without them), so the
  contract's 411/400/413 answers can be given instead of h11's generic refusal; any other
  malformed head becomes a 4xx `Reply` (never a 5xx: it is the client's fault);
- a reply is framed with `Connection: close` whenever the request was not read to its end.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus

import h11

from clef_api import responses
from clef_api.framing import FramingHeaders, reparse_without_framing, scan_framing
from clef_api.responses import Reply


class Need(Enum):
    """What the session is waiting for."""

    DATA = "data"  # more bytes from the client
    CLOSED = "closed"  # nothing more can come on this connection


@dataclass(frozen=True)
class RequestHead:
    """A parsed head, its raw framing headers and its size on the wire.

    `body_readable` is False when h11 refused the framing headers: the head was re-parsed
    without them, so the body's length is unknown and the answer must close the connection.
    """

    request: h11.Request
    framing: FramingHeaders
    size: int
    body_readable: bool = True

    def header(self, name: bytes) -> bytes | None:
        """The first value of a header (`name` lower-case, as h11 keeps names)."""
        value = self._first_values.get(name)
        return bytes(value) if value is not None else None

    @functools.cached_property
    def _first_values(self) -> dict[bytes, bytes]:
        """Each header's first value, from one pass: a request's steps ask for several headers,
        and each walk of h11's header sequence costs a few calls per header."""
        found: dict[bytes, bytes] = {}
        for key, value in self.request.headers:
            found.setdefault(key, value)
        return found


@dataclass(frozen=True)
class RefusedHead:
    """A head h11 refused: its 4xx, and the target of its request line when it has one (so
    the refusal can take its route's form)."""

    reply: Reply
    target: bytes | None


@dataclass(frozen=True)
class BodyEnd:
    """The body is complete."""


BODY_END = BodyEnd()


class Http1Session:
    """One connection's HTTP/1.1 state: `receive` bytes, take events, `frame` replies."""

    def __init__(self, header_limit: int) -> None:
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=header_limit)
        self._raw: bytearray | None = None  # bytes of the head being read (None: not begun)

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Bytes from the client (b"" is end of input)."""
        if self._raw is not None:
            self._raw += data
        self._conn.receive_data(data)

    @property
    def head_begun(self) -> bool:
        """Whether a byte of the next head has arrived (the head timeout then runs)."""
        return bool(self._conn.trailing_data[0]) if self._raw is None else bool(self._raw)

    @property
    def buffered(self) -> int:
        """Received bytes h11 holds for later events (pipelined requests)."""
        return len(self._conn.trailing_data[0])

    def next_head(self) -> RequestHead | RefusedHead | Need:
        """The next request head, a refusal of a malformed one, or what is needed first."""
        if self._raw is None:
            self._raw = bytearray(self._conn.trailing_data[0])  # pipelined bytes already here
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            raw, self._raw = bytes(self._raw), None
            return self._refused_head(raw, exc)
        if isinstance(event, h11.Request):
            size = len(self._raw) - len(self._conn.trailing_data[0])
            head = RequestHead(event, scan_framing(bytes(self._raw[:size])), size)
            self._raw = None
            return head
        if event is h11.NEED_DATA:
            return Need.DATA
        self._raw = None
        return Need.CLOSED

    def _refused_head(self, raw: bytes, exc: h11.RemoteProtocolError) -> RequestHead | RefusedHead:
        """h11 refused a head: rescue it if only its framing headers were at fault."""
        size = len(raw) - len(self._conn.trailing_data[0])
        try:
            rescued = reparse_without_framing(raw[:size]) if size > 0 else None
        except h11.RemoteProtocolError as other_fault:
            exc, rescued = other_fault, None
        if rescued is not None:
            self._conn, request = rescued
            return RequestHead(request, scan_framing(raw[:size]), size, body_readable=False)
        # A malformed head is the client's fault: never a 5xx (h11 hints 501 for codings).
        status = exc.error_status_hint if 400 <= exc.error_status_hint < 500 else 400
        if status == 431:
            reply = responses.error(431, "request header block too large", close=True)
        else:
            reply = responses.error(status, f"malformed request: {str(exc)[:200]}", close=True)
        return RefusedHead(reply, _request_target(raw))

    def next_body_event(self) -> bytes | BodyEnd | Need | Reply:
        """Body bytes, the body's end, a need for more, or 400 when input ended too soon."""
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError:  # EOF before Content-Length bytes
            return responses.error(400, "incomplete body", close=True)
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return BODY_END
        return Need.DATA

    def continue_bytes(self) -> bytes:
        """`100 Continue` if the client waits for it before sending its body, else b""."""
        if self._conn.they_are_waiting_for_100_continue:
            return self._conn.send(h11.InformationalResponse(status_code=100, headers=[]))
        return b""

    def skip_empty_body(self) -> None:
        """Consume the end of a bodyless request, so keep-alive continues.

        Bodies of bodyless routes are never read; if one was sent, the reply closes the
        connection (h11 then still expects body bytes, and `frame` sees that).
        """
        if self._conn.their_state is h11.SEND_BODY:
            with contextlib.suppress(h11.RemoteProtocolError):
                self._conn.next_event()

    # -- output ------------------------------------------------------------------------------

    @property
    def can_answer(self) -> bool:
        """Whether a response may still be framed (none has begun for this request)."""
        return self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    def must_close(self, close: bool) -> bool:
        """Whether the reply must say `Connection: close`: when asked, or when the request was
        not read to its end (its unread bytes cannot be told from a next request)."""
        return close or self._conn.their_state is not h11.DONE

    def frame(
        self, reply: Reply, *, method: bytes, close: bool, extra: list[tuple[str, str]]
    ) -> bytes | None:
        """The whole response as bytes; None if h11 cannot send one now."""
        close = self.must_close(close or reply.close)
        try:
            data = self._conn.send(h11.Response(
                status_code=reply.status,
                headers=reply.headers(close=close) + extra,
                reason=_reason(reply.status),
            ))
            if method != b"HEAD" and reply.body:
                data += self._conn.send(h11.Data(data=reply.body))
            data += self._conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return None
        return data

    @property
    def client_may_be_sending(self) -> bool:
        """After a reply: the client may still send bytes of the request we did not read (the
        socket should then linger before it closes)."""
        return self._conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)

    def start_next_cycle(self) -> bool:
        """After a reply: True (and ready for the next head) if the connection is kept alive."""
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            self._conn.start_next_cycle()
            return True
        return False


def _request_target(raw: bytes) -> bytes | None:
    """The target of a head h11 refused, from its request line, if it has one."""
    parts = raw.split(b"\r\n", 1)[0].split(b" ")
    return parts[1] if len(parts) == 3 else None


@functools.cache
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""

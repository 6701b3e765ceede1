"""One client connection: the h11 loop, one request at a time, in order.

The loop is the shortest correct one, after h11's example server: read until h11 yields a
request head, answer it completely, then start the next cycle or close. Because the next head is
not parsed before the current answer is written, pipelined requests are answered in order, and
HTTP/1.0 and `Connection: close` end the connection as h11 decides.

What the loop adds to h11, and why:
- timeouts: idle keep-alive (no byte of a next request yet) and a stalled head close silently;
  a stalled body gets 408 (contract row 6);
- the raw bytes of each head are kept, because contract rows 1-3 judge framing headers as sent,
  which h11 normalises (see framing.py);
- while a request waits for the worker the socket is still read, so a client that disconnects
  is noticed and its ticket leaves the queue (end of input counts as leaving, a half-close
  included: the read side cannot tell them apart; see docs/api.md); bytes that arrive
  meanwhile (pipelining) are handed to h11, which buffers them for the next cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import h11

from clef_frontend import logs, otel, responses, tracing, workers_ai
from clef_frontend.admission import Admission, Refused, Ticket
from clef_frontend.api import ApiSurface
from clef_frontend.body_rate import BodyClock
from clef_frontend.config import ServerConfig
from clef_frontend.framing import FramingHeaders, reparse_without_framing, scan_framing
from clef_frontend.health import Health
from clef_frontend.metrics import Metrics, route_label
from clef_frontend.responses import Reply
from clef_frontend.routes import Route, check_body, check_post_head, route

log = logging.getLogger("clef_frontend.connection")

READ_SIZE = 256 * 1024
# After an answer sent before the request was fully read (413, 415, 408, a malformed head), how
# long the client's remaining bytes are read and discarded before the socket is closed.
LINGER_SECONDS = 2.0
# How long an answer may take before the socket is watched for the client leaving.
WATCH_AFTER_SECONDS = 0.05
# The shortest wait for body bytes, even past the body's deadline (see _read_body).
MIN_BODY_WAIT = 0.05
# Bodies above this are parsed and validated in a thread, so a large JSON document does not
# stall the event loop (and every other client) for the length of its parse.
INLINE_CHECK_BYTES = 64 * 1024


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


@dataclass
class Exchange:
    """What the access log, the metrics and the trace headers need about one request."""

    method: bytes
    target: bytes
    bytes_in: int = 0
    ticket: Ticket | None = None
    request_id: str = field(default_factory=tracing.new_request_id)
    route: str = "-"
    started: float = field(default_factory=time.monotonic)
    # Traces (otel.py): the W3C trace id for the access line, the server span when tracing,
    # and when the worker's reply arrived (the worker spans end there).
    trace_id: str = tracing.NO_TRACE
    span: otel.RequestSpan | None = None
    answered_at: float | None = None

    @classmethod
    def of(cls, request: h11.Request) -> Exchange:
        """The exchange of a parsed head: its request id and its place in a trace."""
        request_id, context = tracing.trace_context_of(request.headers)
        exchange = cls(request.method, request.target, request_id=request_id)
        exchange.trace_id, exchange.span = otel.begin(
            context, request.method, request.target, request_id, exchange.started)
        logs.bind_request(request_id, exchange.trace_id)
        return exchange

    def trace_headers(self) -> list[tuple[str, str]]:
        """`X-Request-Id`, and `Server-Timing` once the request went through the queue."""
        ticket = self.ticket
        timing = None
        if ticket is not None:
            total_ms = (time.monotonic() - self.started) * 1000.0
            timing = tracing.server_timing(ticket.queue_ms, ticket.worker_ms, total_ms)
        return tracing.response_headers(self.request_id, timing)


class HttpConnection:
    """Serves every request of one client socket; `run()` returns when the socket is done."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        config: ServerConfig,
        admission: Admission,
        health: Health,
        metrics: Metrics,
        api: ApiSurface | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._config = config
        self._admission = admission
        self._health = health
        self._api = api or ApiSurface()
        self._metrics = metrics
        self._exchange: Exchange | None = None  # the request being answered
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=config.header_limit)
        self._idle = False
        self._linger = False
        self._watcher: asyncio.Future[None] | None = None
        peer = writer.get_extra_info("peername")
        self._client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    async def run(self) -> None:
        try:
            while await self._serve_one():
                pass
        except (OSError, TimeoutError) as exc:
            log.debug("connection %s ended: %r", self._client, exc)
        except Exception:
            log.exception("connection %s failed", self._client)
            if self._conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                target = self._exchange.target if self._exchange is not None else None
                reply = self._api.finish(target, responses.error(500, "internal server error",
                                                                 close=True))
                with contextlib.suppress(Exception):
                    await self._send(reply, method=b"")
        finally:
            await self._close()

    def close_if_idle(self) -> None:
        """End of a drain: a connection waiting for its next request is closed now."""
        if self._idle:
            self._writer.close()

    # -- one request ---------------------------------------------------------------------

    async def _serve_one(self) -> bool:
        """Read one request and answer it; True if the connection may carry another."""
        self._exchange = None  # nothing below may answer with the previous request's route
        head = await self._read_head()
        if head is None:
            return False
        if isinstance(head, Reply):  # a malformed head: h11's status hint, then close
            self._exchange = Exchange(b"-", b"-")
            self._count(self._exchange, head.status)
            await self._send(head, method=b"")
            self._log(self._exchange, head.status, len(head.body))
            return False
        exchange = Exchange.of(head.request)
        self._exchange = exchange
        reply = await self._answer(head, exchange)
        if reply is None:  # the client left while its request was queued or in flight
            self._count(exchange, 499)
            self._log(exchange, 499, 0)
            return False
        reply = self._api.finish(exchange.target, reply)
        self._count(exchange, reply.status)
        # A head whose framing h11 refused has a body of unknown length: never read past it.
        await self._send(reply, method=exchange.method, close=not head.body_readable)
        self._log(exchange, reply.status, len(reply.body))
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            self._conn.start_next_cycle()
            return True
        return False

    def _log(self, exchange: Exchange, status: int, bytes_out: int) -> None:
        """The access-log line, once the request is answered (or abandoned)."""
        ticket = exchange.ticket
        logs.request_line(
            method=exchange.method, target=exchange.target, status=status,
            queue_ms=ticket.queue_ms if ticket else None,
            worker_ms=ticket.worker_ms if ticket else None,
            bytes_in=exchange.bytes_in, bytes_out=bytes_out, client=self._client,
            request_id=exchange.request_id, batch=_batch_of(ticket), trace_id=exchange.trace_id,
        )
        otel.end(exchange.span, status=status, route=exchange.route, ticket=ticket,
                 answered_at=exchange.answered_at)

    def _count(self, exchange: Exchange, status: int) -> None:
        """The request's metrics, before its answer is written: a client that has its answer
        (and scrapes next) always finds its request counted."""
        ticket = exchange.ticket
        self._metrics.request_done(
            route=exchange.route, status=status, duration_s=time.monotonic() - exchange.started,
            queue_ms=ticket.queue_ms if ticket else None,
            worker_ms=ticket.worker_ms if ticket else None,
            worker_reply=ticket.worker_reply if ticket else None,
        )

    async def _answer(self, head: RequestHead, exchange: Exchange) -> Reply | None:
        """Route, then the POST checks of http-contract.md in order; None if the client left."""
        request = head.request
        if head.size > self._config.header_limit:
            return responses.error(431, "request header block too large", close=True)
        found = route(request.method, request.target)
        exchange.route = route_label(
            workers_ai.route_path(request.target),
            known=isinstance(found, Route) or found.status == 405)
        if isinstance(found, Reply) or found in (Route.HEALTH, Route.METRICS):
            self._finish_empty_body()
            if isinstance(found, Reply):
                return found
            return self._metrics.public_reply() if found is Route.METRICS else self._health.reply()
        # API key, Workers-AI model name, /v1/models: decided before any body byte is read.
        decided = self._api.decide_from_head(found, request.target,
                                             _header(request, b"authorization"))
        if decided is not None:
            self._finish_empty_body()
            return decided
        # Rows 1-5, from the head alone.
        length = check_post_head(head.framing, _header(request, b"content-type"),
                                 self._config.body_limit)
        if isinstance(length, Reply):
            return length
        # Rows 6-7: read the whole body before anything else happens to it.
        body = await self._read_body(length)
        if isinstance(body, Reply):
            return body
        exchange.bytes_in = len(body)
        # Rows 8-12: parse and validate before admission, so a bad request never waits.
        if len(body) > INLINE_CHECK_BYTES:
            refusal = await asyncio.to_thread(check_body, body, self._config.limits)
        else:
            refusal = check_body(body, self._config.limits)
        if refusal is not None:
            return refusal
        # Row 14 (refusal) or the worker's answer (200, 422, row 13's 500).
        try:
            exchange.ticket = self._admission.submit(body, exchange.request_id)
        except Refused as refused:
            return refused.reply
        reply = await self._await_answer(exchange.ticket)
        exchange.answered_at = time.monotonic()
        return reply

    # -- reading -------------------------------------------------------------------------

    async def _read_head(self) -> RequestHead | Reply | None:
        """Wait for the next head; None means close without a word (EOF, idle, stalled)."""
        loop = asyncio.get_running_loop()
        raw = bytearray(self._conn.trailing_data[0])  # pipelined bytes already received
        deadline = loop.time() + self._config.header_timeout if raw else None
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError as exc:
                return self._refused_head(bytes(raw), exc)
            if isinstance(event, h11.Request):
                size = len(raw) - len(self._conn.trailing_data[0])
                return RequestHead(event, scan_framing(bytes(raw[:size])), size)
            if event is not h11.NEED_DATA:
                return None
            # Before the first byte the connection is idle (keep-alive timeout, and a drain may
            # close it); after it, the whole head must arrive within the header timeout.
            self._idle = deadline is None
            timeout = (self._config.keepalive_timeout if deadline is None
                       else max(deadline - loop.time(), 0.0))
            try:
                async with asyncio.timeout(timeout):  # a timer, not a task per read
                    data = await self._reader.read(READ_SIZE)
            except TimeoutError:
                return None
            finally:
                self._idle = False
            if not data:
                return None
            if deadline is None:
                deadline = loop.time() + self._config.header_timeout
            raw += data
            self._conn.receive_data(data)

    def _refused_head(self, raw: bytes, exc: h11.RemoteProtocolError) -> RequestHead | Reply:
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
        return self._api.finish(_request_target(raw), reply)

    async def _read_body(self, length: int) -> bytes | Reply:
        """The whole body (h11 counts Content-Length), or 408 when it comes too slowly (silence
        or under the minimum rate, body_rate.py), 400 on EOF."""
        if self._conn.they_are_waiting_for_100_continue:
            go_on = h11.InformationalResponse(status_code=100, headers=[])
            self._writer.write(self._conn.send(go_on))
        loop = asyncio.get_running_loop()
        clock = self._config.body_rate_rule.start(loop.time(), length)
        chunks: list[bytes] = []
        while True:
            try:
                event = self._conn.next_event()
            except h11.RemoteProtocolError:  # EOF before Content-Length bytes
                return responses.error(400, "incomplete body", close=True)
            if isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
                clock.record(len(event.data), loop.time())
                # Judged after the bytes are counted: a trickle whose bytes come faster than
                # MIN_BODY_WAIT would otherwise never reach the timeout below.
                if clock.received < length and clock.too_slow(loop.time()):
                    return self._body_too_slow(clock, length, loop.time())
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                try:
                    # Never a zero wait: after a stall of the event loop the kernel may hold
                    # bytes that arrived in time, and they must be read before judging the rate.
                    async with asyncio.timeout(max(clock.wait_limit(loop.time()),
                                                   MIN_BODY_WAIT)):  # a timer, not a task
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    return self._body_too_slow(clock, length, loop.time())
                except ConnectionError:
                    data = b""
                self._conn.receive_data(data)

    def _body_too_slow(self, clock: BodyClock, length: int, now: float) -> Reply:
        log.info("client %s: 408 after %d of %d body bytes: %s", self._client, clock.received,
                 length, clock.too_slow(now) or "too slow")
        return responses.error(408, "request body timed out", close=True)

    def _finish_empty_body(self) -> None:
        """Consume the end of a bodyless request, so keep-alive continues.

        Bodies of other routes are never read; if one was sent, the reply closes the connection
        (h11 then still expects body bytes, and `_send` sees that).
        """
        if self._conn.their_state is h11.SEND_BODY:
            with contextlib.suppress(h11.RemoteProtocolError):
                self._conn.next_event()

    async def _await_answer(self, ticket: Ticket) -> Reply | None:
        """Wait for the ticket's reply; None if the client left meanwhile.

        The socket is watched for the client leaving (and for pipelined bytes) only once the
        answer has taken WATCH_AFTER_SECONDS: most answers come sooner, and a read task per
        request would cost more than the rest of the front's work on it.
        """
        outcome = ticket.outcome
        if outcome.done():
            return outcome.result()
        timer = asyncio.get_running_loop().call_later(WATCH_AFTER_SECONDS, self._watch, ticket)
        try:
            return await outcome
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if outcome.cancelled() and task is not None and not task.cancelling():
                return None  # abandoned by the watcher: the client has gone
            raise
        finally:
            timer.cancel()
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                # Let the cancelled read unwind before anyone reads the stream again (a
                # StreamReader allows one waiter); bytes it read are already with h11.
                watcher.cancel()
                await asyncio.wait({watcher})

    def _watch(self, ticket: Ticket) -> None:
        self._watcher = asyncio.ensure_future(self._watch_socket(ticket))

    async def _watch_socket(self, ticket: Ticket) -> None:
        """Read while the ticket waits: EOF abandons it; other bytes are the next requests."""
        buffered_cap = self._config.header_limit + self._config.body_limit
        while len(self._conn.trailing_data[0]) < buffered_cap:
            try:
                data = await self._reader.read(READ_SIZE)
            except OSError:
                data = b""
            if not data:
                self._admission.abandon(ticket)
                return
            self._conn.receive_data(data)  # the next pipelined request(s)

    # -- writing -------------------------------------------------------------------------

    async def _send(self, reply: Reply, *, method: bytes, close: bool = False) -> None:
        """Frame the reply with h11 and write it; `Connection: close` if we must close.

        We close when asked, when the request was not read to its end, and while draining.
        """
        close = (close or reply.close or self._conn.their_state is not h11.DONE
                 or self._admission.draining)
        try:
            trace = self._exchange.trace_headers() if self._exchange is not None else []
            data = self._conn.send(h11.Response(
                status_code=reply.status,
                headers=reply.headers(close=close) + trace,
                reason=_reason(reply.status),
            ))
            if method != b"HEAD" and reply.body:
                data += self._conn.send(h11.Data(data=reply.body))
            data += self._conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError as exc:
            log.debug("cannot answer %s: %s", self._client, exc)
            return
        self._writer.write(data)
        self._linger = self._conn.their_state not in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)
        # Most answers fit the socket buffer at once: then there is nothing to wait for.
        if self._writer.transport.get_write_buffer_size() or self._writer.transport.is_closing():
            try:
                async with asyncio.timeout(self._config.send_timeout):
                    await self._writer.drain()
            except TimeoutError:
                self._reset_slow_reader()
                raise

    async def _close(self) -> None:
        """Close the socket, lingering if the client may still be sending.

        Closing a TCP socket with unread input makes the kernel send a reset, and a reset can
        destroy the answer we just wrote before the client reads it (the classic lost 413). So
        when the request was not read to its end, half-close first (the client sees our answer
        and EOF) and discard its bytes for a moment, as Apache's and nginx's lingering close do.
        """
        if self._linger and self._writer.can_write_eof() and not self._writer.is_closing():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LINGER_SECONDS
            with contextlib.suppress(OSError, TimeoutError):
                self._writer.write_eof()
                while (left := deadline - loop.time()) > 0:
                    if not await asyncio.wait_for(self._reader.read(READ_SIZE), left):
                        break
        self._writer.close()
        # The transport still flushes what the client has not read; --send-timeout bounds that
        # too, or a client that never reads would keep the socket and its buffer forever.
        try:
            await asyncio.wait_for(self._writer.wait_closed(), self._config.send_timeout)
        except TimeoutError:
            self._reset_slow_reader()
        except OSError:
            pass

    def _reset_slow_reader(self) -> None:
        """Drop a client that did not take its response within --send-timeout: reset at once
        (SO_LINGER 0), so neither the transport nor the kernel keeps its unsent bytes."""
        log.info("client %s did not accept its response within %gs: connection reset",
                 self._client, self._config.send_timeout)
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._writer.transport.abort()


def _header(request: h11.Request, name: bytes) -> bytes | None:
    """The first value of a header (h11 lower-cases names)."""
    for key, value in request.headers:
        if key == name:
            return bytes(value)
    return None


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


def _batch_of(ticket: Ticket | None) -> int | None:
    """The worker forward's size for an answered request (None: no answer from a worker)."""
    reply = ticket.worker_reply if ticket is not None else None
    return reply.batch_size if reply is not None and reply.body is not None else None

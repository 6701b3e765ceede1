"""One client connection: the socket and its timers, one request at a time, in order.

Three layers, as in hypercorn: `http1.Http1Session` turns bytes into request events and replies
into bytes without doing I/O; `pipeline.Pipeline` decides each request's answer in plain async
steps; this module owns the only things that touch the socket or the clock:

- reading: the idle keep-alive timeout (no byte of a next request yet) and the head timeout
  close silently; the body's inactivity and minimum-rate limits (body_rate.py) answer 408;
- while a request waits for the worker the socket is still read, so a client that disconnects
  is noticed and its ticket leaves the queue (end of input counts as leaving, a half-close
  included: the read side cannot tell them apart; see docs/api.md); bytes that arrive
  meanwhile (pipelining) are handed to the session, which buffers them for the next cycle;
- writing: the send deadline, the lingering close after an answer sent before the request was
  read to its end, and the reset of a client that does not read its answer.

The loop is the shortest correct one, after h11's example server: read until a request head,
answer it completely, then start the next cycle or close. Because the next head is not parsed
before the current answer is written, pipelined requests are answered in order, and HTTP/1.0
and `Connection: close` end the connection as h11 decides. The pipeline decides the answer,
gives it its route's form and counts it; this module only sends it and has it logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from clef_api import responses
from clef_api.responses import Reply
from clef_dispatch import Outcome
from clef_frontend.body_rate import BodyClock
from clef_frontend.config import ServerConfig
from clef_frontend.http1 import BodyEnd, Http1Session, Need, RefusedHead, RequestHead
from clef_frontend.pipeline import ClientGone, Pipeline, RequestContext
from clef_frontend.timeout_queue import TimeoutQueue

log = logging.getLogger("clef_frontend.connection")

READ_SIZE = 256 * 1024
# After an answer sent before the request was fully read (413, 415, 408, a malformed head), how
# long the client's remaining bytes are read and discarded before the socket is closed.
LINGER_SECONDS = 2.0
# How long an answer may take before the socket is watched for the client leaving.
WATCH_AFTER_SECONDS = 0.05
# The shortest wait for body bytes, even past the body's deadline (see read_body).
MIN_BODY_WAIT = 0.05


@dataclass(frozen=True)
class ConnectionTimers:
    """The timeouts every connection of one server shares, one timer each (timeout_queue.py):
    `idle` closes a keep-alive connection that sends no byte of a next request in time, and
    `watch` starts watching the socket of a request whose answer is taking a while."""

    idle: TimeoutQueue
    watch: TimeoutQueue

    @classmethod
    def of(cls, config: ServerConfig) -> ConnectionTimers:
        return cls(TimeoutQueue(config.keepalive_timeout), TimeoutQueue(WATCH_AFTER_SECONDS))


class HttpConnection:
    """Serves every request of one client socket; `run()` returns when the socket is done.

    It is also the pipeline's `RequestIO`: the steps read the body and wait for the worker
    through it, so they never see the socket.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        config: ServerConfig,
        pipeline: Pipeline,
        timers: ConnectionTimers | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._config = config
        self._pipeline = pipeline
        self._http = Http1Session(config.header_limit)
        self._ctx: RequestContext | None = None  # the request being answered
        self._idle = False
        self._linger = False
        self._watcher: asyncio.Future[None] | None = None
        self._left = False  # the watcher saw the client leave during the current wait
        self._timers = timers or ConnectionTimers.of(config)
        self._task: asyncio.Task[None] | None = None  # the task serving this connection
        self._idle_expired = False
        self._on_gone: Callable[[], None] = _nothing
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
            if self._http.can_answer:
                ctx = self._ctx or RequestContext(None, self)
                reply = self._pipeline.finish(
                    ctx, responses.error(500, "internal server error", close=True))
                with contextlib.suppress(Exception):
                    await self._send(reply, method=b"", trace=ctx.trace_headers())
        finally:
            await self._close()

    def close_if_idle(self) -> None:
        """End of a drain: a connection waiting for its next request is closed now."""
        if self._idle:
            self._writer.close()

    # -- one request ---------------------------------------------------------------------

    async def _serve_one(self) -> bool:
        """Read one request and answer it; True if the connection may carry another."""
        self._ctx = None  # nothing below may answer with the previous request's route
        head = await self._read_head()
        if head is None:
            return False
        if isinstance(head, RefusedHead):  # a malformed head: its 4xx, then close
            self._ctx = ctx = RequestContext(None, self)
            refusal = self._pipeline.refused_head(ctx, head)
            await self._send(refusal, method=b"", trace=ctx.trace_headers())
            self._pipeline.log(ctx, refusal.status, len(refusal.body), self._client)
            return False
        self._ctx = ctx = RequestContext.of(head, self)
        reply = await self._pipeline.answer(ctx)  # in its route's form, counted
        if reply is None:  # the client left while its request was queued or in flight
            self._pipeline.log(ctx, 499, 0, self._client)
            return False
        # A head whose framing h11 refused has a body of unknown length: never read past it.
        await self._send(reply, method=ctx.method, close=not head.body_readable,
                         trace=ctx.trace_headers())
        self._pipeline.log(ctx, reply.status, len(reply.body), self._client)
        return self._http.start_next_cycle()

    # -- reading (RequestIO) ---------------------------------------------------------------

    async def _read_head(self) -> RequestHead | RefusedHead | None:
        """Wait for the next head; None means close without a word (EOF, idle, stalled)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._config.header_timeout if self._http.head_begun else None
        while True:
            event = self._http.next_head()
            if event is Need.CLOSED:
                return None
            if not isinstance(event, Need):
                return event
            # Before the first byte the connection is idle (the keep-alive timeout, and a
            # drain may close it); after it, the whole head must arrive within the header
            # timeout.
            if deadline is None:
                data = await self._read_idle()
                if data is None:
                    return None
            else:
                try:
                    async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                        data = await self._reader.read(READ_SIZE)
                except TimeoutError:
                    return None
            if not data:
                return None
            if deadline is None:
                deadline = loop.time() + self._config.header_timeout
            self._http.receive(data)

    async def _read_idle(self) -> bytes | None:
        """The first bytes of a next request, or None when the keep-alive timeout passes first
        (the server's one idle queue times it: no timer of this connection's own)."""
        task = self._task = asyncio.current_task()
        assert task is not None
        cancelling = task.cancelling()
        self._idle = True
        self._timers.idle.add(self, self._idle_timed_out)
        try:
            return await self._reader.read(READ_SIZE)
        except asyncio.CancelledError:
            if not self._idle_expired:
                raise
            self._idle_expired = False
            if task.uncancel() > cancelling:  # cancelled by someone else as well
                raise
            return None
        finally:
            self._idle = False
            self._timers.idle.discard(self)

    def _idle_timed_out(self) -> None:
        if self._idle and self._task is not None and not self._idle_expired:
            self._idle_expired = True
            self._task.cancel()

    async def read_body(self, length: int) -> bytes | Reply:
        """The whole body (h11 counts Content-Length), or 408 when it comes too slowly (silence
        or under the minimum rate, body_rate.py), 400 on EOF."""
        go_on = self._http.continue_bytes()
        if go_on:
            self._writer.write(go_on)
        loop = asyncio.get_running_loop()
        clock = self._config.body_rate_rule.start(loop.time(), length)
        chunks: list[bytes] = []
        while True:
            event = self._http.next_body_event()
            if isinstance(event, Reply):
                return event
            if isinstance(event, BodyEnd):
                return b"".join(chunks)
            if isinstance(event, bytes):
                chunks.append(event)
                clock.record(len(event), loop.time())
                # Judged after the bytes are counted: a trickle whose bytes come faster than
                # MIN_BODY_WAIT would otherwise never reach the timeout below.
                if clock.received < length and clock.too_slow(loop.time()):
                    return self._body_too_slow(clock, length, loop.time())
                continue
            try:
                # Never a zero wait: after a stall of the event loop the kernel may hold bytes
                # that arrived in time, and they must be read before judging the rate.
                async with asyncio.timeout(max(clock.wait_limit(loop.time()),
                                               MIN_BODY_WAIT)):  # a timer, not a task
                    data = await self._reader.read(READ_SIZE)
            except TimeoutError:
                return self._body_too_slow(clock, length, loop.time())
            except ConnectionError:
                data = b""
            self._http.receive(data)

    def _body_too_slow(self, clock: BodyClock, length: int, now: float) -> Reply:
        log.info("client %s: 408 after %d of %d body bytes: %s", self._client, clock.received,
                 length, clock.too_slow(now) or "too slow")
        return responses.error(408, "request body timed out", close=True)

    def client_gone(self) -> bool:
        """The client's end of input has been seen (a half-close counts as leaving, as for a
        waiting request), or the socket is closing."""
        return self._reader.at_eof() or self._writer.transport.is_closing()

    def skip_body(self) -> None:
        self._http.skip_empty_body()

    async def wait_answer(
        self, answer: asyncio.Future[Outcome], on_gone: Callable[[], None]
    ) -> Outcome:
        """Wait for the answer; ClientGone if the client left meanwhile.

        The socket is watched for the client leaving (and for pipelined bytes) only once the
        answer has taken WATCH_AFTER_SECONDS: most answers come sooner, and a read task per
        request would cost more than the rest of the front's work on it. When the client leaves,
        `on_gone` ends the wait (by cancelling `answer`) or lets it run on (an answer others
        share); either way the request then ends as ClientGone.
        """
        if answer.done():
            return answer.result()
        self._left = False
        self._on_gone = on_gone
        self._timers.watch.add(self, self._watch)
        try:
            reply = await answer
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if answer.cancelled() and task is not None and not task.cancelling():
                raise ClientGone from None  # abandoned by the watcher: the client has gone
            raise
        finally:
            self._timers.watch.discard(self)
            self._on_gone = _nothing
            watcher, self._watcher = self._watcher, None
            if watcher is not None:
                # Let the cancelled read unwind before anyone reads the stream again (a
                # StreamReader allows one waiter); bytes it read are already in the session.
                watcher.cancel()
                await asyncio.wait({watcher})
        if self._left:
            raise ClientGone  # it left while an answer it shared with others was on its way
        return reply

    def _watch(self) -> None:
        self._watcher = asyncio.ensure_future(self._watch_socket(self._on_gone))

    async def _watch_socket(self, on_gone: Callable[[], None]) -> None:
        """Read while the answer is awaited: EOF means the client left; other bytes are the
        next requests (buffered up to one more request's limits)."""
        buffered_cap = self._config.header_limit + self._config.body_limit
        while self._http.buffered < buffered_cap:
            try:
                data = await self._reader.read(READ_SIZE)
            except OSError:
                data = b""
            if not data:
                self._left = True
                on_gone()
                return
            self._http.receive(data)  # the next pipelined request(s)

    # -- writing ---------------------------------------------------------------------------

    async def _send(
        self, reply: Reply, *, method: bytes, trace: list[tuple[str, str]], close: bool = False
    ) -> None:
        """Frame the reply and write it, with `Connection: close` if we must close (when
        asked, when the request was not read to its end, and while draining)."""
        data = self._http.frame(reply, method=method, close=close or self._pipeline.draining,
                                extra=trace)
        if data is None:
            log.debug("cannot answer %s now", self._client)
            return
        self._writer.write(data)
        self._linger = self._http.client_may_be_sending
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


def _nothing() -> None:
    """What a connection gives up when no answer is awaited."""

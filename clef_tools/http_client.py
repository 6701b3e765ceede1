"""A small keep-alive HTTP/1.1 client on asyncio streams and h11 (already a dependency).

`clef-bench` needs one persistent connection per simulated client, many of them in one event
loop, and nothing else: no redirects, no TLS (point it at the server or at a plain-HTTP
balancer), no cookies. A connection the server closes (`Connection: close`, a restart) is
reopened for the next request, so a long run survives the server's keep-alive timeout. The one
asyncio client of the project: the benchmarks and stress scenarios (`benchlib.http_client`)
use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11

READ_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Endpoint:
    """Where the server listens, from a URL such as `http://127.0.0.1:8000`."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected a URL like http://HOST:PORT, got {url!r} (https is not "
                             "supported: point clef-bench at the server or a plain-HTTP balancer)")
        if parts.path not in ("", "/") or parts.query:
            raise ValueError(f"give the server's base URL without a path, got {url!r}")
        return cls(parts.hostname, parts.port or 80)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class HttpResponse:
    """One answer: its status, its headers (names in lower case, the last value of a repeated
    one) and its whole body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


class HttpConnection:
    """One keep-alive connection; `request` is called by one task at a time."""

    def __init__(self, endpoint: Endpoint, timeout: float = 60.0) -> None:
        self._endpoint = endpoint
        self._timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def request(self, method: str, target: str, body: bytes = b"",
                      headers: tuple[tuple[str, str], ...] = (),
                      timeout: float | None = None) -> HttpResponse:
        """Send one request and read its whole answer within `timeout` (default: the
        connection's); OSError/h11 errors or TimeoutError on failure (the connection is then
        closed and reopened by the next call)."""
        try:
            return await asyncio.wait_for(self._exchange(method, target, body, headers),
                                          self._timeout if timeout is None else timeout)
        except BaseException:
            await self.close()
            raise

    async def _exchange(self, method: str, target: str, body: bytes,
                        headers: tuple[tuple[str, str], ...]) -> HttpResponse:
        if self._writer is None or self._conn.our_state is not h11.IDLE:
            await self.close()
            self._reader, self._writer = await asyncio.open_connection(
                self._endpoint.host, self._endpoint.port)
            self._conn = h11.Connection(h11.CLIENT)
        assert self._reader is not None and self._writer is not None
        head = [("Host", self._endpoint.authority), *headers]
        if method == "POST":
            head += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        data = self._conn.send(h11.Request(method=method, target=target, headers=head))
        if body:
            data = (data or b"") + (self._conn.send(h11.Data(data=body)) or b"")
        data = (data or b"") + (self._conn.send(h11.EndOfMessage()) or b"")
        self._writer.write(data)
        await self._writer.drain()
        status = 0
        received: dict[str, str] = {}
        chunks: list[bytes] = []
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                self._conn.receive_data(await self._reader.read(READ_CHUNK))
            elif isinstance(event, h11.Response):
                status = event.status_code
                received = {name.decode("latin-1"): value.decode("latin-1")
                            for name, value in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection mid-answer")
        if self._conn.our_state is h11.DONE and self._conn.their_state is h11.DONE:
            self._conn.start_next_cycle()
        else:
            await self.close()  # `Connection: close`: the next request opens a new one
        return HttpResponse(status, b"".join(chunks), received)

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

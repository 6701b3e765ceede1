"""The one HTTP/1.1 client of benchmarks, stress scenarios and tests: raw bytes on a socket.

Raw rather than `http.client`: the tests and scenarios write malformed requests, half-close,
pipeline and hold connections open, which a library client would refuse or hide. Two faces of
the same framing: `Client` (blocking, one socket) and `read_answer` (asyncio, a raw stream); both
read `Content-Length`-framed answers, as clef-serve always sends, and skip `100 Continue`. A
well-formed keep-alive exchange on asyncio is clef-bench's own client (`clef_tools.http_client`,
here as `Connection`, with a `post` shorthand).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import select
import socket
from dataclasses import dataclass, field
from typing import Any

from clef_tools.http_client import Endpoint, HttpConnection, HttpResponse

HOST = "127.0.0.1"
WAIT = 10.0  # upper bound for anything that should happen "promptly"


_SEQUENCE = itertools.count()


def clef_request(**extra: Any) -> dict[str, Any]:
    """A minimal valid Clef request, unlike any other this process made (its `seq`): servers
    run with their default answer cache, so each one reaches a worker; a test about sharing
    sends one body again. Extra keys (tags, fake-worker markers, `seq`) are ignored by Clef."""
    return {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}},
            "seq": next(_SEQUENCE), **extra}


def clef_body(**extra: Any) -> bytes:
    return json.dumps(clef_request(**extra)).encode()


def build_request(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    content_type: str | None = "application/json",
    content_length: bool = True,
    version: str = "HTTP/1.1",
) -> bytes:
    lines = [f"{method} {path} {version}", "Host: test"]
    if content_type is not None and method == "POST":
        lines.append(f"Content-Type: {content_type}")
    if content_length and method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    for name, value in headers or []:
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    version: str = "HTTP/1.1"
    extra: dict[str, Any] = field(default_factory=dict)

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def detail(self) -> str:
        return self.json()["detail"]


class Client:
    """A raw HTTP/1.1 client over one socket: write any bytes, read responses in order."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._file = sock.makefile("rb")

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
            self.sock.close()

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, method: str, path: str, body: bytes = b"", **options: Any) -> None:
        """Write one request; `options` are `build_request`'s."""
        self.send_raw(build_request(method, path, body, **options))

    def read_response(self, *, head: bool = False) -> Response:
        """The next response; `head=True` for the answer to a HEAD request (no body)."""
        status_line = self._file.readline()
        if not status_line:
            raise ConnectionError("server closed the connection without a response")
        version, status, reason = status_line.decode("latin-1").rstrip("\r\n").split(" ", 2)
        headers: list[tuple[str, str]] = []
        while True:
            line = self._file.readline().decode("latin-1").rstrip("\r\n")
            if not line:
                break
            name, _, value = line.partition(":")
            headers.append((name, value.strip()))
        response = Response(int(status), reason, headers, b"", version)
        length = response.header("Content-Length")
        if length is not None and int(status) >= 200 and not head:
            response.body = self._file.read(int(length))
        if int(status) < 200:  # an informational response: the real one follows
            return self.read_response(head=head)
        return response

    def at_eof(self, timeout: float = WAIT) -> bool:
        """True once the server has closed its side (waits up to `timeout`)."""
        self.sock.settimeout(timeout)
        try:
            return self._file.read(1) == b""
        except (TimeoutError, ConnectionResetError):
            return False

    def has_data(self, timeout: float) -> bool:
        """Whether the server sent anything (or closed) within `timeout`.

        Only meaningful before any response was read on this client (the file buffer is empty).
        """
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)




# -- asyncio: clef_tools' client (the installed one), with the scenarios' shorthand -----------


async def read_answer(reader: asyncio.StreamReader) -> HttpResponse:
    """One response read from a raw stream (Content-Length framed, as clef-serve always
    answers): for scenarios that write their requests byte by byte themselves."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    if status < 200:  # 100 Continue: the real answer follows
        return await read_answer(reader)
    return HttpResponse(status, body, headers)


class Connection(HttpConnection):
    """One keep-alive connection to a local server (clef_tools' client); reopened after the
    server closes it."""

    def __init__(self, port: int, host: str = HOST) -> None:
        super().__init__(Endpoint(host, port), WAIT)

    async def post(self, body: bytes, timeout: float = WAIT,
                   path: str = "/v1/systemone") -> HttpResponse:
        return await self.request("POST", path, body, timeout=timeout)

"""A zero-work ASGI app: the yardstick `bench_http.py --zero-work` runs under uvicorn.

It answers `POST /v1/systemone` with a small fixed JSON document after reading the body, and
anything else with `{"status": "ready"}`, so what a benchmark of it measures is the HTTP server
alone (uvicorn with its h11 protocol), the same job clef-serve's front does before its worker hop.

    python -m uvicorn benchlib.zero_work_app:app --http h11 --port 8001
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]

_ANSWER = b'{"answers": {"q": {"answer": "yes"}}}'
_HEALTH = b'{"status": "ready"}'
_HEADERS = [(b"content-type", b"application/json")]


async def app(
    scope: Scope,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """Read the whole body (as a real handler must), then answer a constant."""
    if scope["type"] != "http":  # lifespan: accept start-up and shutdown
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    body = _ANSWER if scope["method"] == "POST" else _HEALTH
    headers = [*_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})

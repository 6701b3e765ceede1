"""An unexpected exception while answering still gives the client an answer in its route's form.

The connection's last resort is a 500 `internal server error`; on the Workers-AI route that 500
must come in Cloudflare's envelope like every other error there, so a client that parses only
the envelope still reads it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from clef_dispatch import WorkerSettings
from clef_frontend.config import ServerConfig
from clef_frontend.connection import HttpConnection
from clef_frontend.pipeline import Pipeline, RequestContext

RUN = b"/accounts/acct-1/ai/run/@cf/cloudflare/clef-flash"


async def _explode(ctx: RequestContext) -> None:
    """A step that fails the way an unforeseen bug would."""
    raise RuntimeError("a bug nobody foresaw")


async def _exchange(target: bytes) -> tuple[int, dict[str, Any]]:
    served = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        config = ServerConfig(WorkerSettings(("unused",)))
        not_draining = SimpleNamespace(draining=False)
        pipeline = Pipeline(config=config, dispatch=not_draining,
                            health=None, metrics=None)  # type: ignore[arg-type]
        pipeline.steps = [pipeline.route, _explode]  # routed (so the form is known), then a bug
        connection = HttpConnection(reader, writer, config=config, pipeline=pipeline)
        await connection.run()
        served.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"state": "x", "questions": {}}'
    writer.write(b"POST " + target + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    raw = await reader.read()  # the connection closes after its last-resort answer
    writer.close()
    await served.wait()
    server.close()
    await server.wait_closed()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload)


@pytest.mark.parametrize(("target", "expected"), [
    (b"/v1/systemone", {"detail": "internal server error"}),
    (RUN, {"result": None, "success": False, "messages": [],
           "errors": [{"code": 500, "message": "internal server error"}]}),
])
def test_an_unexpected_failure_answers_500_in_the_routes_form(target: bytes,
                                                              expected: dict[str, Any]) -> None:
    status, document = asyncio.run(_exchange(target))
    assert status == 500
    assert document == expected

"""The front's test helpers: `clef-serve` against tests/fake_worker.py, talked to in raw HTTP.

The server process and the client are the helper layer's (`benchlib.serve`,
`benchlib.http_client`), shared with the stress scenarios and the benchmarks; they are imported
here under the names the tests use, and this module adds what only the tests need.
"""

from __future__ import annotations

from benchlib.http_client import WAIT, Client, Response, build_request, clef_body, clef_request
from benchlib.net import free_port, port_is_open
from benchlib.paths import FAKE_WORKER, REPO
from benchlib.serve import LISTENING, Serve, background

__all__ = ["FAKE_WORKER", "LISTENING", "REPO", "WAIT", "Client", "Response", "Serve",
           "assert_refused_as_malformed", "background", "build_request", "clef_body",
           "clef_request", "free_port", "port_is_open"]


def assert_refused_as_malformed(server: Serve, raw: bytes) -> None:
    """`raw` on a fresh connection is answered 400 `malformed request...` and closed."""
    with server.connect() as client:
        client.send_raw(raw)
        response = client.read_response()
        assert response.status == 400
        assert response.detail.startswith("malformed request")
        assert client.at_eof()

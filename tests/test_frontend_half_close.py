"""The chosen half-close behaviour (docs/api.md): end of input from a client is its departure.

Made deterministic by queueing: a held request keeps the worker busy, so the half-closing
client's request is still waiting when its end of input arrives, whatever the machine's speed.
"""

from __future__ import annotations

import socket
from pathlib import Path

from tests.frontend_helpers import Serve, build_request, clef_body


def test_a_half_closed_client_is_taken_as_gone_and_its_request_dropped(tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "worker.log"
    # One in flight, so the half-closed client's request waits in the queue behind the held one.
    with Serve("--log-file", str(log), max_batch=1) as serve:
        running = serve.hold_in_flight(gate)
        client = serve.connect()
        client.send_raw(build_request("POST", "/v1/systemone", clef_body(tag="half-closed")))
        serve.wait_health(lambda h: h["queue_depth"] == 1)  # complete, admitted, waiting
        client.sock.shutdown(socket.SHUT_WR)  # what `nc -N` does after sending
        serve.wait_for(r"dropped from the queue: client gone")
        assert client.at_eof()  # closed without a response
        serve.wait_for(r"path=/v1/systemone status=499 ")
        gate.touch()
        assert running.result().json()["tag"] == "running"
        assert serve.post(clef_body(tag="after")).json()["tag"] == "after"
        client.close()
    assert log.read_text().split() == ["running", "after"]  # the worker never saw it

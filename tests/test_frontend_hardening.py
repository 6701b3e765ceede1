"""Hardening through real sockets: slow bodies and slow readers, back-off after useful work,
malformed framing never 501, the listen backlog."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from clef_frontend.cli import build_parser, config_from
from tests.ci_policy import require
from tests.frontend_helpers import (
    WAIT,
    Response,
    Serve,
    assert_refused_as_malformed,
    background,
    build_request,
    clef_body,
)


def exact_error(detail: str) -> bytes:
    return json.dumps({"detail": detail}).encode()


# -- slow bodies ---------------------------------------------------------------------------


def test_a_trickled_body_is_cut_off_by_the_minimum_rate() -> None:
    # Silence alone (30 s) would never fire: a byte comes every 50 ms. The rate rule (1,000 B/s
    # after 1 s) must answer 408 long before the 10,000-byte body is complete.
    front = ("--body-timeout", "30", "--body-min-rate", "1000", "--body-rate-grace", "1")
    body = clef_body(state="x" * 10_000)
    with Serve(front_args=front) as serve, serve.connect() as client:
        request = build_request("POST", "/v1/systemone", body)
        client.send_raw(request[: -len(body)])
        done = threading.Event()

        def read() -> Response:
            try:
                return client.read_response()
            finally:
                done.set()

        answered = background(read)
        sent = 0
        for byte in body:  # bounded: at most the whole body
            try:
                client.send_raw(bytes([byte]))
            except OSError:
                break
            sent += 1
            if done.wait(0.05):  # the attacker's pace; stops as soon as the answer came
                break
        response = answered.result(WAIT)
        assert (response.status, response.body) == (408, exact_error("request body timed out"))
        assert sent < len(body)
        serve.wait_for(r"408 after \d+ of \d+ body bytes: body arrived at \d+ B/s, under the "
                       r"minimum 1000 B/s")


def test_a_body_sent_promptly_is_unaffected_by_the_rate_rule() -> None:
    with Serve(front_args=("--body-min-rate", "1000", "--body-rate-grace", "0")) as serve:
        assert serve.post(clef_body(tag="fast", state="y" * 200_000)).status == 200


# -- slow readers --------------------------------------------------------------------------


def test_a_client_that_never_reads_its_response_is_reset_after_the_send_timeout() -> None:
    # The fake worker echoes the tag: a 4 MB tag makes a 4 MB response, far more than the
    # client's small receive buffer and the server's buffers can hold.
    with Serve(front_args=("--send-timeout", "1")) as serve:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", serve.port))
        sock.settimeout(WAIT)
        with sock:
            sock.sendall(build_request("POST", "/v1/systemone", clef_body(tag="t" * 4_000_000)))
            serve.wait_for(r"did not accept its response within 1s: connection reset")
            received = 0
            try:
                while chunk := sock.recv(1 << 16):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            # Dropped, not flushed: the client never gets the whole response.
            assert received < 4_000_000
        assert serve.health().status == 200


# -- back-off ------------------------------------------------------------------------------


def test_backoff_resets_after_a_worker_served_and_grows_in_a_crash_loop() -> None:
    def delays() -> list[tuple[float, str]]:
        return [(float(d), why) for d, why in
                re.findall(r"starting a new worker in ([0-9.]+)s \((.*)\)$", serve.stderr, re.M)]

    def crash_after(ok: int, restarts: int) -> None:
        for _ in range(ok):
            assert serve.post(clef_body()).status == 200
        # A worker that answers 500 and exits (a sticky device error): one death per request
        # (a request lost with a crashed worker would be sent again, and kill a second one).
        assert serve.post(clef_body(cuda_error=True)).status == 500
        serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == restarts)

    with Serve(front_args=("--restart-backoff", "0.05", "--restart-backoff-max", "1")) as serve:
        for restarts in (1, 2, 3):  # each worker answered two requests, then crashed
            crash_after(2, restarts)
        crash_after(0, 4)  # then two crash-loop deaths: no request answered
        crash_after(0, 5)
        crash_after(1, 6)  # one answer ends the loop
    assert delays() == [
        (0.05, "served 2 requests before dying"),
        (0.05, "served 2 requests before dying"),
        (0.05, "served 2 requests before dying"),
        (0.05, "crash loop: no request answered"),
        (0.1, "crash loop: no request answered (2 consecutive failures)"),
        (0.05, "served 1 request before dying"),
    ]


# -- malformed framing: 4xx from the contract, never 501 ---------------------------------------

ROW1 = exact_error("Content-Length is required; chunked requests are unsupported")


@pytest.fixture(scope="module")
def plain() -> Iterator[Serve]:
    with Serve() as server:
        yield server


@pytest.mark.parametrize("raw", [
    # A coding other than chunked with no Host: h11 used to win with its 501.
    b"POST /v1/systemone HTTP/1.1\r\nTransfer-Encoding: gzip\r\n"
    b"Content-Type: application/json\r\n\r\n",
    # ... with two Host lines.
    b"POST /v1/systemone HTTP/1.1\r\nHost: a\r\nHost: b\r\nTransfer-Encoding: gzip\r\n"
    b"Content-Type: application/json\r\n\r\n",
    b"GET /health HTTP/1.1\r\nTransfer-Encoding: identity\r\n\r\n",
    b"POST /v1/systemone HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
    # Two Transfer-Encoding lines (h11's other 501), no Host.
    b"POST /v1/systemone HTTP/1.1\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n",
    # Obsolete line folding is never rescued; the answer is still a 400, not h11's 501.
    b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nX-A: 1\r\n"
    b" folded\r\n\r\n",
])
def test_malformed_head_with_a_transfer_coding_is_400_not_501(plain: Serve, raw: bytes) -> None:
    assert_refused_as_malformed(plain, raw)


@pytest.mark.parametrize("raw", [
    b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n"
    b"Content-Type: application/json\r\n\r\n",
    b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
    # HTTP/1.0 needs no Host: the head is well formed, so contract row 1 answers.
    b"POST /v1/systemone HTTP/1.0\r\nTransfer-Encoding: gzip\r\n\r\n",
])
def test_a_transfer_coding_with_a_good_head_is_row1_411(plain: Serve, raw: bytes) -> None:
    with plain.connect() as client:
        client.send_raw(raw)
        response = client.read_response()
        assert (response.status, response.body) == (411, ROW1)


# -- listen backlog ------------------------------------------------------------------------


def test_the_listen_backlog_is_what_was_asked() -> None:
    ss = require("ss")  # reads the listening socket's backlog
    with Serve(front_args=("--backlog", "37")) as serve:
        serve.wait_for(r"listening on http://\S+ \(backlog 37\)")
        listing = subprocess.run([ss, "-ltnH", f"sport = :{serve.port}"], check=True,
                                 capture_output=True, text=True).stdout
        # For a listening socket, ss shows the backlog in the Send-Q column.
        send_queues = {int(line.split()[2]) for line in listing.splitlines() if line.strip()}
        assert send_queues == {37}


def test_the_new_flags_reach_the_config_and_bad_values_are_refused() -> None:
    parser = build_parser()
    config = config_from(parser.parse_args(["--backlog", "64", "--body-min-rate", "0",
                                            "--body-rate-grace", "2.5"]))
    assert (config.backlog, config.body_min_rate, config.body_rate_grace) == (64, 0.0, 2.5)
    assert config.body_rate_rule.min_rate == 0.0  # 0 turns the rate check off
    defaults = config_from(parser.parse_args([]))
    assert (defaults.backlog, defaults.body_min_rate, defaults.body_rate_grace) == (2048, 1024, 5)
    for bad in (["--backlog", "0"], ["--body-min-rate", "-1"], ["--body-min-rate", "fast"],
                ["--body-rate-grace", "inf"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)

"""Two replicas behind a real nginx running the shipped deploy/nginx/clef-serve.conf.

nginx (the Debian package; .ci/run installs it) is started on loopback with its own main config,
pid file, logs and temp directories; only the replica addresses and the listen address of the
shipped file are changed. One replica's front is killed with SIGKILL while clients keep sending:
nginx must retry every request it had sent there on the other replica, so no client sees a
failure. When the replica comes back (its port opens only once its worker is warm) it gets
traffic again.
"""

from __future__ import annotations

import functools
import http.client
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci_policy import require
from tests.conftest import REPO
from tests.frontend_helpers import WAIT, Serve, background, clef_body, free_port

SHIPPED = REPO / "deploy" / "nginx" / "clef-serve.conf"
CLIENTS = 6
REQUESTS_PER_CLIENT = 40
KILL_AFTER = 40  # successful answers before the kill, so the load is well under way
RECOVERY_WAIT = 60.0  # the shipped fail_timeout is 5 s


def site_config(upstreams: list[int], listen: int) -> str:
    """The shipped file with its two example replicas and its listen address replaced."""
    text = SHIPPED.read_text()
    example = re.compile(r"^    server 10\.0\.0\.\d+:8000 (.*);$", re.MULTILINE)
    options = example.findall(text)
    assert len(options) == 2, "the shipped upstream should list two example replicas"
    text = example.sub("", text)
    servers = "".join(f"    server 127.0.0.1:{port} {options[0]};\n" for port in upstreams)
    text = text.replace("upstream clef_serve {\n", "upstream clef_serve {\n" + servers, 1)
    assert "    listen 80;\n" in text
    return text.replace("    listen 80;\n", f"    listen 127.0.0.1:{listen};\n", 1)


class Nginx:
    """nginx in the foreground with everything under `root`."""

    def __init__(self, binary: str, root: Path, upstreams: list[int]) -> None:
        self.port = free_port()
        (root / "clef-serve.conf").write_text(site_config(upstreams, self.port))
        temp = "".join(f"    {kind}_temp_path {root}/{kind};\n"
                       for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        user = "user root root;\n" if os.geteuid() == 0 else ""
        (root / "nginx.conf").write_text(
            f"{user}daemon off;\nworker_processes 1;\npid {root}/nginx.pid;\n"
            f"error_log {root}/error.log info;\n"
            "events { worker_connections 256; }\n"
            f"http {{\n    access_log {root}/access.log;\n{temp}"
            f"    include {root}/clef-serve.conf;\n}}\n"
        )
        self.root = root
        self.process = subprocess.Popen(
            [binary, "-p", str(root), "-e", str(root / "error.log"), "-c",
             str(root / "nginx.conf")],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        self._wait_accepting()

    def _wait_accepting(self) -> None:
        deadline = time.monotonic() + WAIT
        while True:
            if self.process.poll() is not None:
                output = self.process.stdout.read().decode() if self.process.stdout else ""
                raise AssertionError(f"nginx exited: {output}\n{self.error_log}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1)
                connection.request("GET", "/health")
                connection.getresponse().read()
                connection.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"nginx never accepted\n{self.error_log}") from None
                time.sleep(0.02)  # polling for the socket, bounded by the deadline

    @property
    def error_log(self) -> str:
        path = self.root / "error.log"
        return path.read_text() if path.exists() else ""

    def post(self, connection: http.client.HTTPConnection, request_id: str | None = None
             ) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        connection.request("POST", "/v1/systemone", clef_body(), headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: finish, then exit
            try:
                self.process.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(WAIT)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def nginx_path() -> str:
    return require("nginx")


@pytest.fixture
def replicas() -> Iterator[list[Serve]]:
    servers = [Serve("--delay", "0.005"), Serve("--delay", "0.005")]
    try:
        yield servers
    finally:
        for server in servers:
            server.close()


def worker_pid(serve: Serve) -> int:
    return int(serve.health().json()["worker"]["pid"])


def test_failover_through_nginx_loses_no_request(
    nginx_path: str, replicas: list[Serve], tmp_path: Path
) -> None:
    nginx = Nginx(nginx_path, tmp_path, [r.port for r in replicas])
    try:
        victim, survivor = replicas
        victim_port = victim.port
        pids = {worker_pid(victim): "victim", worker_pid(survivor): "survivor"}
        successes = 0
        answered_by: dict[str, int] = {"victim": 0, "survivor": 0}
        failures: list[str] = []
        lock = threading.Lock()
        under_way = threading.Event()

        def client(index: int) -> None:
            nonlocal successes
            connection = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=30)
            try:
                for n in range(REQUESTS_PER_CLIENT):
                    request_id = f"load-{index}-{n}"
                    try:
                        status, headers, body = nginx.post(connection, request_id)
                    except (OSError, http.client.HTTPException) as exc:
                        with lock:
                            failures.append(f"{request_id}: {exc!r}")
                        connection.close()
                        continue
                    with lock:
                        if status != 200 or headers.get("X-Request-Id") != request_id:
                            failures.append(f"{request_id}: {status} {body[:200]!r}")
                            continue
                        successes += 1
                        who = pids.get(_answering_pid(body), "?")
                        answered_by[who] = answered_by.get(who, 0) + 1
                        if successes >= KILL_AFTER:
                            under_way.set()
            finally:
                connection.close()

        clients = [background(functools.partial(client, i)) for i in range(CLIENTS)]
        assert under_way.wait(60), f"the load never got going: {failures}"
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(WAIT)
        for call in clients:
            call.result(timeout=120)
        assert failures == [], "\n".join(failures[:20]) + "\n" + nginx.error_log[-3000:]
        assert successes == CLIENTS * REQUESTS_PER_CLIENT
        assert answered_by["victim"] > 0 and answered_by["survivor"] > 0, answered_by
        # nginx did meet the dead replica (reset or refused) and retried elsewhere.
        met = [line for line in nginx.error_log.splitlines()
               if f"127.0.0.1:{victim_port}" in line and "[error]" in line]
        assert met, nginx.error_log

        # The replica returns on the same port; once its worker is warm it opens the port and
        # nginx, after fail_timeout, sends it traffic again.
        returned = Serve("--delay", "0.005", port=victim_port)
        replicas[0] = returned
        assert returned.health().json()["status"] == "ready"
        new_pid = worker_pid(returned)
        deadline = time.monotonic() + RECOVERY_WAIT
        connection = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=30)
        try:
            while True:
                status, _, body = nginx.post(connection)
                assert status == 200, body
                if _answering_pid(body) == new_pid:
                    break
                assert time.monotonic() < deadline, "nginx never sent traffic to the replica"
                time.sleep(0.05)  # paced probing, bounded by the deadline
        finally:
            connection.close()
    finally:
        nginx.close()


def _answering_pid(body: bytes) -> int:
    """The fake worker's pid in its answer."""
    match = re.search(rb'"pid": (\d+)', body)
    assert match is not None, body
    return int(match[1])

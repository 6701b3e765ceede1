"""What the shared-traffic tests share: a metric read from a live server, load from a few
client threads, and waiting on a condition with a bound (never a fixed sleep)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.frontend_helpers import WAIT, Response, Serve


def metric(serve: Serve, name: str, **labels: str) -> float:
    """One sample of `/metrics` (0.0 when the series does not exist yet)."""
    response = serve.request("GET", "/metrics")
    assert response.status == 200
    for family in text_string_to_metric_families(response.body.decode()):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


def wait_until(condition: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll `condition` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)  # polling interval, not a synchronisation guess


def load(serve: Serve, bodies: list[bytes], clients: int = 4) -> list[tuple[Response, float]]:
    """POST every body from `clients` threads at once; each answer with its latency (s)."""

    def post(body: bytes) -> tuple[Response, float]:
        began = time.monotonic()
        response = serve.post(body)
        return response, time.monotonic() - began

    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(post, bodies))


def workers_of(serve: Serve) -> list[dict[str, Any]]:
    """`/health`'s `workers` list: each worker's status, pid, models and figures."""
    workers: list[dict[str, Any]] = serve.health().json()["workers"]
    return workers


def restart_worker(serve: Serve, index: int, timeout: float = 240.0) -> None:
    """Kill worker `index` with SIGKILL (a crash, a stall kill) and wait until its replacement,
    another process, is ready (a real worker loads and checks itself first: hence the
    timeout)."""
    pid = workers_of(serve)[index]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: workers_of(serve)[index]["status"] == "ready"
               and workers_of(serve)[index]["pid"] not in (None, pid),
               f"worker {index}'s replacement", timeout=timeout)

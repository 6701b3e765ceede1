"""The endpoint picker's three gauges (clef_requests_queued, clef_requests_in_flight,
clef_token_budget_usage_ratio): what they mean (clef_dispatch/load.py), and that they move under
load from one slow worker, read through a real front's /metrics."""

from __future__ import annotations

import asyncio
import math
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from benchlib.http_client import Client
from clef_dispatch.load import (
    MAX_TOKENS_PER_BYTE,
    PRIOR_TOKENS_PER_BYTE,
    TokenEstimate,
    token_budget,
    utilisation,
)
from clef_dispatch.worker_errors import WorkerExited
from clef_frontend.exposition import render
from clef_frontend.metrics import LiveState, Metrics
from clef_protocol.messages import ReadyInfo
from clef_protocol.options import DEFAULT_MAX_BATCH_TOKENS_CPU
from tests.doubles import Admission, reply_of
from tests.frontend_helpers import Serve, clef_body
from tests.test_frontend_units import FakeLane, FakeWorkers
from tests.test_observability import parse_metrics, scrape, value

QUEUED, RUNNING, USAGE = ("clef_requests_queued", "clef_requests_in_flight",
                          "clef_token_budget_usage_ratio")

# -- the rules, as pure functions ----------------------------------------------------------------


def test_estimate_is_bounded_by_one_token_and_the_max_length() -> None:
    estimate = TokenEstimate(max_length=100)
    assert estimate.cost(0) == 1
    assert estimate.cost(40) == math.ceil(40 * PRIOR_TOKENS_PER_BYTE)
    assert estimate.cost(10_000_000) == 100  # the worker cuts the state to fit


def test_estimate_learns_the_ratio_from_answers_within_bounds() -> None:
    estimate = TokenEstimate(max_length=10_000)
    for _ in range(500):
        estimate.learn(1000, 500)  # half a token per byte
    assert estimate.tokens_per_byte == pytest.approx(0.5, abs=1e-3)
    for _ in range(500):
        estimate.learn(10, 1000)  # a hundred per byte: held at the bound
    assert estimate.tokens_per_byte == pytest.approx(MAX_TOKENS_PER_BYTE, abs=1e-3)
    before = estimate.tokens_per_byte
    estimate.learn(0, 5)  # nothing to learn from an empty body or no tokens
    estimate.learn(5, 0)
    assert estimate.tokens_per_byte == before


def test_budget_is_the_ready_workers_forward_budgets() -> None:
    def ready(device: str, max_batch_tokens: int = 0) -> ReadyInfo:
        return ReadyInfo(model="m", variant="v", device=device, dtype="bfloat16",
                         gdn_path="fla", max_batch_tokens=max_batch_tokens)

    # As each worker reports it in `ready`, whatever its device; a worker that reports none
    # counts one request of --max-length (the front never assumes the worker's own defaults).
    assert token_budget([ready("cuda", 1000), ready("cpu", 3000)], 16384) == 4000
    assert token_budget([ready("cuda"), ready("cpu", 1000)], 16384) == 16384 + 1000
    assert token_budget([ready("cpu")], 512) == 512
    assert token_budget([], 16384) == 0


def test_utilisation_is_capped_and_full_without_a_ready_worker() -> None:
    assert utilisation(0, 4096) == 0.0
    assert utilisation(1024, 4096) == 0.25
    assert utilisation(10_000, 4096) == 1.0
    assert utilisation(0, 0) == 1.0  # nothing can be served: a picker must send nothing


def test_admissions_token_counts_follow_every_way_a_ticket_leaves() -> None:
    """Sent, abandoned, expired, lost with its worker and resent, refused, answered: the
    estimated tokens waiting and in flight always equal those of the tickets still there, and
    end at zero (a count that drifted would misreport the pod to the picker forever)."""
    async def scenario() -> None:
        lane = FakeLane(room=1)
        admission = Admission(capacity=8, retry_after=1, workers=FakeWorkers(lane),
                              estimate=TokenEstimate(max_length=1000))
        body = b"x" * 40  # 10 tokens at the prior ratio

        def counts() -> tuple[int, int]:
            return admission.tokens_waiting, admission.tokens_in_flight

        sent = admission.submit(body)
        left = admission.submit(body)
        waits = admission.submit(body)
        expires = admission.submit(body, deadline=time.monotonic() + 0.05)
        assert counts() == (30, 10)
        admission.abandon(left)
        assert counts() == (20, 10)
        assert (await reply_of(expires)).status == 504  # the deadline timer answered it
        assert counts() == (10, 10)
        lane.held.pop(0)[1](WorkerExited("worker closed its output"))  # resent, alone
        assert counts() == (10, 10) and lane.in_flight == 1 and admission.depth == 1
        lane.answer_oldest()
        assert (await reply_of(sent)).status == 200
        assert counts() == (0, 10)  # `waits` took the worker
        refused = admission.submit(body)
        assert counts() == (10, 10)
        admission.refuse_waiting("worker is restarting")
        assert (await reply_of(refused)).status == 503
        assert counts() == (0, 10)
        lane.answer_oldest()
        assert (await reply_of(waits)).status == 200
        assert counts() == (0, 0)

    asyncio.run(scenario())


# -- through a real front --------------------------------------------------------------------------


def expected_tokens(*bodies: bytes) -> int:
    """What admission charged for these bodies before any answer taught it a ratio."""
    return sum(math.ceil(len(body) * PRIOR_TOKENS_PER_BYTE) for body in bodies)


def test_gauges_move_under_load_from_one_slow_worker(tmp_path: Path) -> None:
    """One worker held on a request (the fake worker waits for a file), two more waiting:
    queued 2, running 1, utilisation their estimated tokens over the CPU worker's budget.
    Synchronised on /health's counters, never on time. Production defaults otherwise, except
    one request in flight per worker (`max_batch=1`), so the other two wait in the front's
    queue and the counts are exact."""
    gate = tmp_path / "gate"
    with Serve(max_batch=1) as serve:
        idle = scrape(serve)
        assert (value(idle, QUEUED), value(idle, RUNNING), value(idle, USAGE)) == (0, 0, 0)
        running = serve.hold_in_flight(gate)
        waiting = serve.queue(["first", "second"])
        busy = scrape(serve)
        assert value(busy, QUEUED) == 2
        assert value(busy, RUNNING) == 1
        held = expected_tokens(clef_body(tag="running", hold_until=str(gate)),
                               clef_body(tag="first"), clef_body(tag="second"))
        usage = value(busy, USAGE)
        assert 0 < usage <= 1
        assert usage == pytest.approx(held / DEFAULT_MAX_BATCH_TOKENS_CPU)
        gate.touch()
        assert [call.result().status for call in (running, *waiting)] == [200, 200, 200]
        serve.wait_health(lambda h: h["queue_depth"] == 0 and h["in_flight"] == 0)
        done = scrape(serve)
        assert (value(done, QUEUED), value(done, RUNNING), value(done, USAGE)) == (0, 0, 0)


def test_utilisation_saturates_at_one_on_the_metrics_port(tmp_path: Path) -> None:
    """A budget smaller than what is held reads 1, not more: `--max-batch-tokens 16` (the test
    is about the cap) and `--metrics-port` (the scrape a picker makes in the manifests, served
    by its own thread while the event loop holds the requests); one request in flight per
    worker (`max_batch=1`) so the second waits in the front's queue."""
    gate = tmp_path / "gate"
    with Serve(max_batch=1,
               front_args=("--metrics-port", "0", "--max-batch-tokens", "16")) as serve:
        port = int(serve.wait_for(r"metrics on http://[^\s:]+:(\d+)/metrics")[1])
        running = serve.hold_in_flight(gate)
        [waiting] = serve.queue(["waiting"])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            samples = parse_metrics(answer.read().decode())
        assert (value(samples, QUEUED), value(samples, RUNNING)) == (1, 1)
        assert value(samples, USAGE) == 1.0
        gate.touch()
        assert running.result().status == 200 and waiting.result().status == 200


# -- the exposition the picker scrapes -----------------------------------------------------------


def test_the_fast_exposition_has_every_sample_of_prometheus_clients_but_created() -> None:
    """exposition.render writes what generate_latest writes, less the `_created` series."""
    metrics = Metrics(LiveState(queue_depth=lambda _: 3, in_flight=lambda: 2, queue_capacity=64,
                                worker_ready=lambda: True, worker_info=lambda: None,
                                queued=lambda: 3, token_usage=lambda: 0.5), version="t\"e\\st")
    metrics.request_done(route="/v1/systemone", status=200, duration_s=0.01, scoring=True,
                         queue_ms=1.0, worker_ms=2.0, key='a"b\\c\nd')
    metrics.quota_refused("k")
    ours = parse_metrics(render(metrics.registry).decode())
    theirs = {key: sample for key, sample in
              parse_metrics(generate_latest(metrics.registry).decode()).items()
              if not key[0].endswith("_created")}
    assert ours == theirs
    assert value(ours, QUEUED) == 3 and value(ours, USAGE) == 0.5


def test_the_metrics_port_keeps_a_scrapers_connection_alive() -> None:
    """A picker's client reuses its connection: two scrapes on one socket, both answered."""
    with Serve(front_args=("--metrics-port", "0")) as serve:
        port = int(serve.wait_for(r"metrics on http://[^\s:]+:(\d+)/metrics")[1])
        with Client(socket.create_connection(("127.0.0.1", port), timeout=10)) as client:
            for _ in range(2):
                client.send("GET", "/metrics")
                response = client.read_response()
                assert response.status == 200
                assert value(parse_metrics(response.body.decode()), USAGE) == 0

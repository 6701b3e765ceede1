"""Priority classes: waiting interactive requests are admitted before waiting bulk ones, FIFO
within a class, and bulk never starves. Asserted on admission order (the fake worker's request
log), never on timing."""

from __future__ import annotations

import asyncio
from pathlib import Path

from clef_dispatch.admission import BULK_EVERY
from tests.doubles import Admission, FakeLane, FakeWorkers
from tests.frontend_helpers import Serve, background, clef_body
from tests.traffic_helpers import metric

BULK_KEY = "sk-ingest-4c4c4c"
# The ordering tests hold one request at the worker so the others wait in the queue, where the
# classes are ordered: one request in flight per worker instead of the CPU default.
ONE = 1
ROUTER_KEY = "sk-router-7a7a7a"


def _queue(serve: Serve, tag: str, headers: list[tuple[str, str]]) -> background:
    """POST one request and return once it is visibly waiting in the queue."""
    depth = serve.health().json()["queue_depth"]
    call = background(lambda: serve.post(clef_body(tag=tag), headers=headers))
    serve.wait_health(lambda h: h["queue_depth"] == depth + 1)
    return call


def test_interactive_requests_overtake_a_bulk_flood(tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    bulk = [("X-Clef-Priority", "bulk")]
    with Serve("--log-file", str(log), max_batch=ONE) as serve:
        running = serve.hold_in_flight(gate)
        waiting = [_queue(serve, f"b{i}", bulk) for i in range(3)]
        waiting += [_queue(serve, "i0", []), _queue(serve, "i1",
                                                    [("X-Clef-Priority", "interactive")])]
        assert metric(serve, "clef_queue_depth", **{"class": "bulk"}) == 3
        assert metric(serve, "clef_queue_depth", **{"class": "interactive"}) == 2
        gate.touch()
        assert [call.result().status for call in [running, *waiting]] == [200] * 6
        assert log.read_text().split() == ["running", "i0", "i1", "b0", "b1", "b2"]
        assert metric(serve, "clef_request_queue_seconds_count", **{"class": "bulk"}) == 3


def test_a_keys_class_is_its_default_and_the_header_overrides_it(tmp_path: Path) -> None:
    keys, gate, log = tmp_path / "keys.toml", tmp_path / "gate", tmp_path / "requests.log"
    keys.write_text(f'[keys.rag-ingest]\nkey = "{BULK_KEY}"\npriority = "bulk"\n'
                    f'[keys.router]\nkey = "{ROUTER_KEY}"\n')
    ingest = [("Authorization", f"Bearer {BULK_KEY}")]
    router = [("Authorization", f"Bearer {ROUTER_KEY}")]
    with Serve("--log-file", str(log), front_args=("--api-key-file", str(keys)),
               max_batch=ONE) as serve:
        running = background(lambda: serve.post(clef_body(tag="running", hold_until=str(gate)),
                                                headers=router))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        waiting = [_queue(serve, "ingest", ingest), _queue(serve, "router", router),
                   _queue(serve, "urgent-ingest", [*ingest, ("X-Clef-Priority", "interactive")])]
        gate.touch()
        assert [call.result().status for call in [running, *waiting]] == [200] * 4
        assert log.read_text().split() == ["running", "router", "urgent-ingest", "ingest"]


def test_a_malformed_priority_is_400_before_the_body_is_read() -> None:
    with Serve() as serve:
        refused = serve.post(clef_body(), headers=[("X-Clef-Priority", "urgent")])
        assert refused.status == 400
        assert refused.detail == "X-Clef-Priority must be one of interactive, bulk, got 'urgent'"


def test_bulk_never_starves_under_sustained_interactive_load() -> None:
    async def scenario() -> list[bytes]:
        lane = FakeLane(room=1)
        admission = Admission(capacity=100, retry_after=1, workers=FakeWorkers(lane))
        admission.submit(b"first")  # in flight: everything below waits
        for i in range(2):
            admission.submit(f"b{i}".encode(), priority="bulk")
        for i in range(2 * BULK_EVERY):
            admission.submit(f"i{i}".encode())
        while lane.held:
            lane.answer_oldest()
        return lane.sent

    sent = asyncio.run(scenario())
    order = [body.decode() for body in sent[1:]]
    # One admission in every BULK_EVERY goes to bulk while both classes wait.
    assert order.index("b0") == BULK_EVERY - 1
    assert order.index("b1") == 2 * BULK_EVERY - 1
    interactive = [name for name in order if name.startswith("i")]
    assert interactive == [f"i{i}" for i in range(2 * BULK_EVERY)]  # FIFO within a class

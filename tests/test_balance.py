"""Load spread across workers: short and unrelated requests go to the least loaded worker; only a
state long enough for the worker's prefix cache to keep is routed to the worker that may hold
it, and only while that worker is within a load margin of the least loaded. Over HTTP with four
fake workers keeping a simulated prefix cache, then admission over fake lanes."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

from clef_dispatch import prefix_key
from clef_dispatch.affinity import AFFINITY_BYTES, MIN_STATE_TOKENS, load_margin
from clef_worker.serving.prefix import cache as prefix_cache
from tests.doubles import Admission, FakeLane, FakeWorkers
from tests.frontend_helpers import Serve, background, clef_body

LONG = "a shared document " * (AFFINITY_BYTES // 8)


def _request(state: Any, tag: int = 0) -> dict[str, Any]:
    return {"model": "clef-flash", "state": state, "questions": {"q": {"type": "noul"}},
            "tag": tag}


def test_the_keyed_length_is_the_worker_caches_smallest_state() -> None:
    assert MIN_STATE_TOKENS == prefix_cache.MIN_STATE_TOKENS


def test_sixteen_distinct_requests_held_at_once_spread_four_a_worker_over_http(
        tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    with Serve("--fake-prefix-cache", front_args=("--workers", "4")) as serve:
        bodies = [clef_body(state=f"customer {i} asks", hold_until=str(gate))
                  for i in range(16)]
        calls = [background(functools.partial(serve.post, body)) for body in bodies]
        health = serve.wait_health(lambda h: h["in_flight"] == 16)
        assert [worker["in_flight"] for worker in health["workers"]] == [4, 4, 4, 4]
        gate.touch()
        assert [call.result().status for call in calls] == [200] * 16
        # An agent's turns on one long state, one after the other, stay on one worker.
        pids = {serve.post(json.dumps(_request(LONG + f" turn {turn}")).encode()).json()["pid"]
                for turn in range(4)}
        assert len(pids) == 1


def _held(lanes: tuple[FakeLane, ...], requests: list[dict[str, Any]]) -> list[int]:
    """Admit `requests` at once (none answered) over `lanes`: how many each lane holds."""
    async def scenario() -> list[int]:
        admission = Admission(capacity=64, retry_after=1, workers=FakeWorkers(*lanes))
        for request in requests:
            admission.submit(json.dumps(request).encode(), affinity=prefix_key(request))
        return [lane.in_flight for lane in lanes]

    return asyncio.run(scenario())


def _lanes() -> tuple[FakeLane, ...]:
    return tuple(FakeLane(room=8, prefix_slot=str(i)) for i in range(4))


def test_short_and_templated_short_states_spread_by_load() -> None:
    distinct = [_request(f"state {i}") for i in range(16)]
    # One template, the customer last: their first power-of-two bytes are alike.
    templated = [_request({"history": ["opened", "paid", "shipped"],
                           "note": "the customer asks where the parcel is", "zid": i})
                 for i in range(16)]
    assert _held(_lanes(), distinct) == [4, 4, 4, 4]
    assert _held(_lanes(), templated) == [4, 4, 4, 4]


def test_a_long_state_stays_with_its_worker_within_the_load_margin() -> None:
    lanes = _lanes()
    margin = load_margin(lanes[0])
    assert margin == 2  # a quarter of a forward of eight
    held = _held(lanes, [_request(LONG + f" question {i}") for i in range(16)])
    assert sum(held) == 16 and max(held) - min(held) <= margin
    preferred = held.index(max(held))
    assert held[preferred] == min(held) + margin  # its own worker, as far as the margin goes


def test_a_long_states_requests_one_at_a_time_all_reach_one_worker() -> None:
    async def scenario() -> list[int]:
        lanes = _lanes()
        admission = Admission(capacity=64, retry_after=1, workers=FakeWorkers(*lanes))
        for turn in range(8):
            request = _request(LONG + " event" * turn)
            admission.submit(json.dumps(request).encode(), affinity=prefix_key(request))
            next(lane for lane in lanes if lane.held).answer_oldest()
        return [len(lane.sent) for lane in lanes]

    assert sorted(asyncio.run(scenario())) == [0, 0, 0, 8]

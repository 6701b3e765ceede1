"""Prefix affinity (clef_dispatch/affinity.py): requests whose state starts alike go to the
worker whose prefix cache may hold it while that worker has room; otherwise the usual round
robin. Unit tests of the key and the choice over fake lanes, then two real fronts' workers
(the fake worker with a simulated prefix cache) each keeping their own states' requests, with
/health, the metrics and Server-Timing showing the cache."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from typing import Any

from clef_dispatch import prefix_key
from clef_dispatch.affinity import (
    AFFINITY_BYTES,
    KEYED_STATE_BYTES,
    leading_state_bytes,
    preferred_lane,
    rendezvous_order,
)
from tests.doubles import Admission, FakeLane, FakeWorkers
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric

# A state well past the key's leading bytes, so its growth never changes its key.
LONG = "x" * (2 * AFFINITY_BYTES)


def _key(request: dict[str, Any]) -> bytes:
    """The prefix key of a request long enough to have one."""
    key = prefix_key(request)
    assert key is not None
    return key


def _request(state: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "clef-flash", "state": state, "questions": {"q": {"type": "noul"}},
            **extra}


def _states_preferring(names: list[str]) -> dict[str, str]:
    """For each slot name, a long state whose key ranks it first among `names`."""
    found: dict[str, str] = {}
    for i in range(1000):
        state = f"agent {i}: " + LONG
        first = names[rendezvous_order(_key(_request(state)), names)[0]]
        found.setdefault(first, state)
        if len(found) == len(names):
            return found
    raise AssertionError("no state preferring every slot in 1000 tries")


# -- the key ---------------------------------------------------------------------------------

def test_a_state_that_grows_keeps_its_key_and_other_questions_do_not_change_it() -> None:
    first = prefix_key(_request(LONG))
    grown = prefix_key(_request(LONG + " more events", questions={"other": {"type": "noul"}}))
    assert grown == first


def test_a_short_state_keeps_its_key_until_its_length_doubles() -> None:
    start = "s" * 300
    assert leading_state_bytes(start) == start[:256].encode()
    assert prefix_key(_request(start)) == prefix_key(_request(start + "t" * 200))  # 500 bytes
    assert prefix_key(_request(start)) != prefix_key(_request(start[:200] + "t" * 400))
    assert leading_state_bytes("é" * 600) == ("é" * 512).encode()  # bytes, not characters
    assert leading_state_bytes(LONG) == LONG[:AFFINITY_BYTES].encode()


def test_only_a_state_a_worker_could_keep_or_media_get_a_key() -> None:
    """A state under KEYED_STATE_BYTES (MIN_STATE_TOKENS bytes: surely fewer tokens than the
    worker's prefix cache keeps) has no key and is spread by load; media are keyed whatever
    the state."""
    short = "s" * (KEYED_STATE_BYTES - 1)
    assert prefix_key(_request(short)) is None
    assert prefix_key(_request({"customer": "a", "items": [1, 2]})) is None
    assert prefix_key(_request(short + "s")) is not None
    assert prefix_key(_request("s", images=["data:image/png;base64,AAAA"])) is not None


def test_model_media_and_leading_state_bytes_each_change_the_key() -> None:
    base = prefix_key(_request(LONG))
    assert prefix_key({**_request(LONG), "model": "clef-flash-support"}) != base
    assert prefix_key(_request(LONG, images=["data:image/png;base64,AAAA"])) != base
    assert prefix_key(_request("y" + LONG)) != base
    one_image = prefix_key(_request(LONG, images=["data:image/png;base64,AAAA"]))
    assert prefix_key(_request(LONG, images=["data:image/png;base64,AAAB"])) != one_image
    # A large media entry is sampled at both ends: a change at its end still counts.
    big = "data:image/png;base64," + "A" * 100_000
    assert (prefix_key(_request(LONG, images=[big + "A"]))
            != prefix_key(_request(LONG, images=[big + "B"])))


def test_a_json_state_is_keyed_as_rendered_sorted_whatever_the_client_order() -> None:
    one = prefix_key(_request({"b": [1, 2], "a": "text", "z": LONG}))
    other = prefix_key(_request({"z": LONG, "a": "text", "b": [1, 2]}))
    assert one is not None and one == other
    assert prefix_key(_request({"a": "other", "b": [1, 2], "z": LONG})) != one


def test_rendezvous_keeps_every_other_key_in_place_when_a_worker_leaves() -> None:
    names = ["0", "1", "2", "3"]
    moved = 0
    for i in range(200):
        key = _key(_request(f"state {i}" + LONG))
        before = names[rendezvous_order(key, names)[0]]
        after_names = [name for name in names if name != "2"]
        after = after_names[rendezvous_order(key, after_names)[0]]
        if before != "2":
            assert after == before  # only the keys of the worker that left move
        else:
            moved += 1
    assert 20 < moved < 80  # and the keys spread over the workers (about a quarter each)


# -- the choice --------------------------------------------------------------------------------

def test_the_preferred_worker_is_chosen_while_it_has_room_then_the_second_in_its_order() -> None:
    lanes = [FakeLane(room=2, prefix_slot=name) for name in ("0", "1", "2")]
    key = _key(_request(LONG))
    order = rendezvous_order(key, ["0", "1", "2"])
    first, second = lanes[order[0]], lanes[order[1]]
    assert preferred_lane(key, lanes, ()) is first
    first.held = [object(), object()]  # type: ignore[list-item]  # full
    assert preferred_lane(key, lanes, ()) is second
    assert preferred_lane(key, lanes, {second}) is lanes[order[2]]  # running a resend alone
    assert preferred_lane(None, lanes, ()) is None  # no key: the usual choice


def test_workers_without_a_prefix_cache_are_never_preferred() -> None:
    lanes = [FakeLane(room=2), FakeLane(room=2)]
    assert preferred_lane(prefix_key(_request(LONG)), lanes, ()) is None


def test_admission_sends_each_states_requests_to_its_own_worker_and_spills_when_full() -> None:
    states = _states_preferring(["0", "1"])

    async def scenario() -> tuple[FakeLane, FakeLane]:
        lanes = (FakeLane(room=2, prefix_slot="0"), FakeLane(room=2, prefix_slot="1"))
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(*lanes))
        for turn in range(3):  # one at a time: each answered before the next is sent
            for slot in ("0", "1"):
                state = states[slot] + f" turn {turn}"
                body = json.dumps(_request(state)).encode()
                admission.submit(body, affinity=prefix_key(_request(state)))
                lanes[int(slot)].answer_oldest()
        # Three of state 0's requests at once, while both workers have room.
        for turn in range(3):
            state = states["0"] + f" burst {turn}"
            admission.submit(f"burst {turn}".encode(), affinity=prefix_key(_request(state)))
        return lanes

    zero, one = asyncio.run(scenario())
    assert [states["0"] in body.decode() for body in zero.sent[:3]] == [True] * 3
    assert [states["1"] in body.decode() for body in one.sent[:3]] == [True] * 3
    # Its worker takes it while within one request (a quarter of a forward of two, at least
    # one) of the least loaded: the second goes to the idle worker, the third back to its own.
    assert zero.sent[3:] == [b"burst 0", b"burst 2"]
    assert one.sent[3:] == [b"burst 1"]


def test_a_waiting_request_goes_to_its_worker_when_that_frees_and_elsewhere_when_not() -> None:
    states = _states_preferring(["0", "1"])
    mine = prefix_key(_request(states["0"]))

    async def scenario() -> tuple[FakeLane, FakeLane]:
        lanes = (FakeLane(room=1, prefix_slot="0"), FakeLane(room=1, prefix_slot="1"))
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(*lanes))
        admission.submit(b"a", affinity=mine)     # on 0
        admission.submit(b"b", affinity=mine)     # 0 is full: spills to 1
        admission.submit(b"c", affinity=mine)     # both full: waits
        admission.submit(b"d", affinity=mine)     # waits
        lanes[0].answer_oldest()                  # 0 frees: c goes to its own worker
        lanes[1].answer_oldest()                  # 1 frees first now: d is not held back
        return lanes

    zero, one = asyncio.run(scenario())
    assert zero.sent == [b"a", b"c"]
    assert one.sent == [b"b", b"d"]


def test_without_keys_or_caches_requests_spread_and_a_key_stays_within_the_margin() -> None:
    async def scenario(slots: tuple[str | None, str | None], key: bytes | None) -> list[int]:
        lanes = (FakeLane(room=4, prefix_slot=slots[0]), FakeLane(room=4, prefix_slot=slots[1]))
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(*lanes))
        for i in range(4):
            admission.submit(f"r{i}".encode(), affinity=key)
        return [len(lane.sent) for lane in lanes]

    key = _key(_request(LONG))
    assert asyncio.run(scenario(("0", "1"), None)) == [2, 2]  # no key
    assert asyncio.run(scenario((None, None), key)) == [2, 2]  # no worker keeps a cache
    # Both keep one: the state's worker while within the margin (one of a forward of four).
    assert sorted(asyncio.run(scenario(("0", "1"), key))) == [2, 2]


# -- through a real front ----------------------------------------------------------------------

REUSED = re.compile(r'prefix;desc="reused=(\d+)"')


def test_two_workers_each_keep_their_own_states_requests_and_show_their_caches() -> None:
    states = _states_preferring(["0", "1"])
    with Serve("--fake-prefix-cache", front_args=("--workers", "2")) as serve:
        pids = [worker["pid"] for worker in serve.health().json()["workers"]]
        served: dict[str, set[int]] = {"0": set(), "1": set()}
        reused: dict[str, list[int]] = {"0": [], "1": []}
        for turn in range(4):
            for slot in ("0", "1"):
                state = states[slot] + "".join(f" event {n}" for n in range(turn))
                questions = {f"q{turn}": {"type": "noul"}}
                body = json.dumps(_request(state, questions=questions, tag=slot)).encode()
                response = serve.post(body)
                assert response.status == 200
                served[slot].add(response.json()["pid"])
                timing = response.header("Server-Timing") or ""
                found = REUSED.search(timing)
                assert found is not None, timing
                reused[slot].append(int(found[1]))
        assert served == {"0": {pids[0]}, "1": {pids[1]}}
        for slot in ("0", "1"):
            assert reused[slot][0] == 0  # the first turn finds nothing
            assert min(reused[slot][1:]) >= len(states[slot]) // 4  # each later one, its state
        health = serve.health().json()
        for slot, worker in zip(("0", "1"), health["workers"], strict=True):
            cache = worker["prefix_cache"]
            assert cache["enabled"] is True and cache["disabled_reason"] == ""
            assert cache["entries"] == 4 and cache["lookups"] == 4 and cache["hits"] == 3
            assert cache["tokens_reused"] == sum(reused[slot])
            assert metric(serve, "clef_prefix_cache_hits_total", worker=slot) == 3
            assert metric(serve, "clef_prefix_cache_tokens_reused_total",
                          worker=slot) == sum(reused[slot])
            assert metric(serve, "clef_prefix_cache_entries", worker=slot) == 4
            assert metric(serve, "clef_prefix_cache_bytes", worker=slot) == cache["bytes"] > 0
            assert metric(serve, "clef_prefix_cache_enabled", worker=slot) == 1
            assert metric(serve, "clef_prefix_cache_turned_off", worker=slot) == 0


def test_workers_whose_cache_is_off_say_so_and_get_the_round_robin() -> None:
    with Serve("--fake-prefix-cache", front_args=("--workers", "2", "--prefix-cache", "off")
               ) as serve:
        pids = []
        for turn in range(4):
            response = serve.post(json.dumps(_request(LONG + f" turn {turn}")).encode())
            assert response.status == 200
            assert 'prefix;desc="reused=0"' in (response.header("Server-Timing") or "")
            pids.append(response.json()["pid"])
        workers = serve.health().json()["workers"]
        assert {w["prefix_cache"]["disabled_reason"] for w in workers} == {"--prefix-cache off"}
        assert {w["prefix_cache"]["enabled"] for w in workers} == {False}
        assert {w["prefix_cache"]["turned_off"] for w in workers} == {False}
        assert metric(serve, "clef_prefix_cache_enabled", worker="0") == 0
        assert metric(serve, "clef_prefix_cache_turned_off", worker="0") == 0  # the flag's
    assert pids[0] != pids[1] and pids[:2] == pids[2:]  # one state, both workers in turn


def test_a_cache_the_self_check_turned_off_is_flagged_for_the_alert() -> None:
    """A worker whose start-up prefixed probe disagreed (the fake's stand-in): /health says why,
    `clef_prefix_cache_turned_off` is 1 (what the ClefPrefixCacheTurnedOff alert watches, unlike
    a cache off by flag), and its requests are served uncached."""
    with Serve("--fake-prefix-cache-disagrees") as serve:
        response = serve.post(json.dumps(_request(LONG)).encode())
        assert response.status == 200
        assert 'prefix;desc="reused=0"' in (response.header("Server-Timing") or "")
        [worker] = serve.health().json()["workers"]
        assert worker["prefix_cache"]["enabled"] is False
        assert worker["prefix_cache"]["disabled_reason"].startswith("self-check: the prefixed")
        assert worker["prefix_cache"]["turned_off"] is True
        assert metric(serve, "clef_prefix_cache_turned_off", worker="0") == 1
        assert metric(serve, "clef_prefix_cache_enabled", worker="0") == 0


def test_a_replaced_worker_shows_its_own_empty_cache_not_the_lost_ones_figures() -> None:
    with Serve("--fake-prefix-cache") as serve:
        for turn in range(2):
            assert serve.post(json.dumps(_request(LONG + f" turn {turn}")).encode()).status == 200
        before = serve.health().json()["workers"][0]
        assert before["prefix_cache"]["hits"] == 1 and before["prefix_cache"]["entries"] == 2
        os.kill(before["pid"], signal.SIGKILL)
        after = serve.wait_health(lambda h: h["status"] == "ready"
                                  and h["workers"][0]["pid"] != before["pid"])
        cache = after["workers"][0]["prefix_cache"]
        assert (cache["bytes"], cache["entries"], cache["hits"], cache["lookups"]) == (0, 0, 0, 0)
        assert metric(serve, "clef_prefix_cache_hits_total", worker="0") == 0

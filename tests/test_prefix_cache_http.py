"""The prefix cache end to end: the real worker on the tiny snapshot (CPU) behind clef-serve with
its defaults (the prefix cache on) answers the three workloads of bench/bench_prefix_cache.py,
at small sizes, exactly as a server with `--prefix-cache off` does (within 1.5e-4), and says
what it reused: Server-Timing per request, /health and the metrics per worker; a media agent
(one screenshot, a growing state) too."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from benchlib.paths import TINY_SNAPSHOT
from benchlib.prefix_workloads import (
    ANSWER_TOLERANCE,
    agent_loop,
    fan_out,
    max_difference,
    tokenizer_of,
    unrelated,
)
from clef_dispatch import prefix_key
from clef_dispatch.affinity import rendezvous_order
from clef_protocol.media import gradient_image, png_data_uri
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric

REUSED = re.compile(r'prefix;desc="reused=(\d+)"')
MODEL = ("--model", str(TINY_SNAPSHOT), "--device", "cpu")
STATE_TOKENS = 700


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Serve]]:
    """The default server and one with the prefix cache off (the reference), started together."""
    default = Serve(real_worker=True, startup_wait=240, wait_listening=False, front_args=MODEL)
    off = Serve(real_worker=True, startup_wait=240, wait_listening=False,
                front_args=(*MODEL, "--prefix-cache", "off"))
    try:
        for server in (default, off):
            server.port = int(server.wait_for(r"listening on http://\S+:(\d+)", 240)[1])
        yield {"on": default, "off": off}
    finally:
        default.close()
        off.close()


def _ask(serve: Serve, body: bytes) -> tuple[bytes, int, int]:
    """The answer, the tokens its worker reused (Server-Timing) and the tokens it read."""
    response = serve.post(body)
    assert response.status == 200, response.body
    found = REUSED.search(response.header("Server-Timing") or "")
    assert found is not None, response.header("Server-Timing")
    return response.body, int(found[1]), int(response.json()["usage"]["input_tokens"])


def test_every_workload_answers_as_without_the_cache_and_reuses_what_it_shares(
        servers: dict[str, Serve]) -> None:
    tokenizer = tokenizer_of(TINY_SNAPSHOT)
    workloads = {
        "agent_loop": agent_loop(tokenizer, STATE_TOKENS, STATE_TOKENS + 300, 150),
        "fan_out": fan_out(tokenizer, STATE_TOKENS, 3),
        "unrelated": unrelated(tokenizer, 2, 400),
    }
    reused: dict[str, list[int]] = {}
    for name, workload in workloads.items():
        reused[name] = []
        for body in workload.requests:
            on, tokens_reused, read = _ask(servers["on"], body)
            off, none_reused, _ = _ask(servers["off"], body)
            assert max_difference(on, off) <= ANSWER_TOLERANCE, (name, on, off)
            assert none_reused == 0
            assert tokens_reused < read  # the questions are always computed
            reused[name].append(tokens_reused)
    # (a) each turn reuses the state before it, (b) each set after the first the whole state
    # (its end is cached, rounded down to the cache's alignment), (c) nothing.
    assert reused["agent_loop"][0] == 0
    assert min(reused["agent_loop"][1:]) >= STATE_TOKENS - 64
    assert reused["fan_out"][0] == 0
    assert min(reused["fan_out"][1:]) >= STATE_TOKENS - 64
    assert reused["unrelated"] == [0, 0]

    worker = servers["on"].health().json()["workers"][0]["prefix_cache"]
    total = sum(map(sum, reused.values()))
    assert worker["enabled"] is True and worker["disabled_reason"] == ""
    assert worker["tokens_reused"] == total
    assert worker["hits"] == len(workloads["agent_loop"].requests) - 1 + 2
    assert worker["entries"] > 0 and 0 < worker["bytes"] <= worker["capacity_bytes"]
    assert metric(servers["on"], "clef_prefix_cache_tokens_reused_total", worker="0") == total
    assert metric(servers["on"], "clef_prefix_cache_bytes", worker="0") == worker["bytes"]
    reference = servers["off"].health().json()["workers"][0]["prefix_cache"]
    assert reference["enabled"] is False and reference["disabled_reason"] == "--prefix-cache off"
    assert reference["tokens_reused"] == 0


def test_two_real_workers_each_keep_their_own_states_and_reuse_them() -> None:
    """With two workers (the defaults otherwise), an agent's turns stay on the worker that read
    its state, so every turn after the first reuses it, for two agents on two workers."""
    tokenizer = tokenizer_of(TINY_SNAPSHOT)
    loops: dict[str, list[bytes]] = {}
    for seed in range(1, 50):  # two agents whose states the rendezvous order puts apart
        requests = agent_loop(tokenizer, 300, 450, 150, seed=seed).requests
        key = prefix_key(json.loads(requests[0]))
        assert key is not None  # a state the workers' caches keep
        first = rendezvous_order(key, ["0", "1"])[0]
        loops.setdefault(str(first), requests)
        if len(loops) == 2:
            break
    assert set(loops) == {"0", "1"}
    with Serve(real_worker=True, startup_wait=240,
               front_args=(*MODEL, "--workers", "2")) as serve:
        for turn in range(2):
            for slot in ("0", "1"):
                _, reused, _ = _ask(serve, loops[slot][turn])
                assert (reused > 0) == (turn > 0), (slot, turn, reused)
        workers = serve.health().json()["workers"]
    assert [w["prefix_cache"]["lookups"] for w in workers] == [2, 2]
    assert [w["prefix_cache"]["hits"] for w in workers] == [1, 1]


def test_a_media_agent_reuses_its_screenshot_and_state_and_answers_as_without_the_cache(
        servers: dict[str, Serve]) -> None:
    """The same screenshot every turn with a growing state: each turn after the first reuses
    past the picture, answers as the `--prefix-cache off` server, and counts in /health."""
    picture = png_data_uri(gradient_image(256, 256))
    bodies = [json.dumps(dict(json.loads(body), images=[picture])).encode()
              for body in agent_loop(tokenizer_of(TINY_SNAPSHOT), 400, 550, 150).requests]
    before = servers["on"].health().json()["workers"][0]["prefix_cache"]
    reused = []
    for body in bodies:
        on, tokens_reused, _ = _ask(servers["on"], body)
        off, _, _ = _ask(servers["off"], body)
        assert max_difference(on, off) <= ANSWER_TOLERANCE, (on, off)
        reused.append(tokens_reused)
    # The picture's 64 tokens and the prompt before it are reused with the previous state.
    assert reused[0] == 0 and min(reused[1:]) >= 400 - 64
    after = servers["on"].health().json()["workers"][0]["prefix_cache"]
    assert after["hits"] - before["hits"] == len(bodies) - 1
    assert after["tokens_reused"] - before["tokens_reused"] == sum(reused)
    assert metric(servers["on"], "clef_prefix_cache_tokens_reused_total",
                  worker="0") == after["tokens_reused"]

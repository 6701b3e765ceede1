"""What the GPU sitting sends (benchlib/gpu_workloads.py): distinct fresh states that no cache
can answer, hits on one stored prefix, and the replay table the fresh figures are set against,
checked with the demo snapshot's tokenizer on CPU."""

from __future__ import annotations

import itertools
import json

import pytest

from benchlib.flash_model import RequestSizer, make_request
from benchlib.gpu_workloads import (
    DistinctStates,
    HitBodies,
    bucket_replay_ms,
    replay_table,
    timing_of,
)


@pytest.fixture(scope="module")
def sizer() -> RequestSizer:
    return RequestSizer()


def test_every_state_is_distinct_from_its_first_token_and_long_enough(
        sizer: RequestSizer) -> None:
    questions = make_request(sizer, 0, 1)["questions"]
    states = DistinctStates(sizer.encoder.tokenizer,
                            lambda request: len(sizer.encode(request).input_ids), questions)
    bodies = [states.body(400) for _ in range(12)]
    assert len(set(bodies)) == 12
    encoded = [sizer.encode(json.loads(body)).input_ids for body in bodies]
    tokenizer = sizer.encoder.tokenizer
    for body, ids in zip(bodies, encoded, strict=True):
        assert 390 <= len(ids) <= 420  # about the length asked for
        state = json.loads(body)["state"]
        assert len(tokenizer.encode(state, add_special_tokens=False).ids) >= 256
    # no two share a prefix past the prompt before the state (shorter than one 64-token
    # cache block), so no cached block can be reused
    prompt = len(sizer.encode({**json.loads(bodies[0]), "state": ""}).input_ids)
    for a, b in itertools.combinations(encoded, 2):
        common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        assert common < 64, (common, prompt)


def test_hits_keep_the_stored_state_and_add_their_own_tokens(sizer: RequestSizer) -> None:
    questions = make_request(sizer, 0, 1)["questions"]
    hits = HitBodies(sizer.encoder.tokenizer, questions, prefix_tokens=600, new_tokens=200)
    stored = json.loads(hits.store_body())["state"]
    first, second = (json.loads(hits.next_body())["state"] for _ in range(2))
    assert first.startswith(stored) and second.startswith(stored) and first != second
    tokenizer = sizer.encoder.tokenizer
    extra = len(tokenizer.encode(first, add_special_tokens=False).ids) - len(
        tokenizer.encode(stored, add_special_tokens=False).ids)
    assert 200 <= extra <= 260


def test_server_timing_gives_the_worker_time_and_the_reused_tokens() -> None:
    assert timing_of('worker;dur=12.5, prefix;desc="reused=6592"') == (12.5, 6592)
    assert timing_of("worker;dur=3") == (3.0, 0)
    assert timing_of(None) == (None, 0)


def test_a_length_is_set_against_the_smallest_bucket_that_holds_it() -> None:
    log = ("x worker: replayed 3 shapes once; replay ms: {'4096': 80.5, '8192': 157.0, "
           "'16384': 300.1}\n")
    table = replay_table(log)
    assert table == {"4096": 80.5, "8192": 157.0, "16384": 300.1}
    assert bucket_replay_ms(table, 7004) == ("8192", 157.0)
    assert bucket_replay_ms(table, 20000) is None
    # padded rows x length: only one-row shapes hold one request
    padded = {"(1, 512)": 9.0, "(4, 256)": 12.0, "(1, 1024)": 15.0}
    assert bucket_replay_ms(padded, 300) == ("(1, 512)", 9.0)
    assert replay_table("no such line") == {}


def test_start_up_phases_are_read_wherever_health_puts_them() -> None:
    from bench.bench_gpu_http import startup_of

    phases = {"phases": {"imports": 8.0, "load": 9.0, "capture": 50.0}}
    assert startup_of({"startup": phases}) == phases
    assert startup_of({"worker": {"startup": phases}}) == phases
    assert startup_of({"workers": [{"startup": phases}]}) == phases
    assert startup_of({"worker": {}, "workers": [{}]}) is None


def test_quick_mode_keeps_a_steps_choice_to_skip_fresh_states_and_hits() -> None:
    """The later HTTP steps turn the fresh-state and hit phases off; quick mode shrinks them
    to its 512 tokens only where they are on, so a dry run runs what the GPU run runs."""
    from bench.bench_gpu_http import parse_args

    on = parse_args(["--quick"])
    assert on.state_lengths == [400] and on.hit == [260, 100] and on.restart == "on"
    assert on.hit[0] >= 256  # a state long enough to store points
    off = parse_args(["--quick", "--state-lengths", "--hit", "0", "0", "--restart", "off"])
    assert off.state_lengths == [] and off.hit == [0, 0] and off.restart == "off"

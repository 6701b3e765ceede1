"""Duplicates answered once: identical concurrent requests share one forward, a repeat costs
none, a request in another order or for another key never shares, a reload onto the same weights
keeps what was kept (fake worker's request log). Servers run the default configuration: the
cache is on."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clef_api.responses import from_outcome
from clef_dispatch import (
    BULK,
    EXPIRED_DETAIL,
    INTERACTIVE,
    SHARED_EXPIRED_DETAIL,
    Answer,
    Outcome,
    Refusal,
    RefusalKind,
)
from clef_dispatch.ticket import Ticket, TicketView
from clef_frontend.answer_cache import (
    COALESCED,
    HIT,
    MISS,
    NOT_SHARED,
    AnswerCache,
    Shared,
    identity,
)
from clef_protocol.messages import INFERENCE_FAILED, WorkerReply
from tests.frontend_helpers import Serve, background, clef_body, clef_request
from tests.traffic_helpers import metric, wait_until

KEY_A = "sk-tenant-a-111111"
KEY_B = "sk-tenant-b-222222"


def bearer(key: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {key}")]


def test_eight_identical_concurrent_requests_cost_one_forward_and_a_repeat_none(
        tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    body = clef_body(tag="same", hold_until=str(gate))
    with Serve("--log-file", str(log)) as serve:
        calls = [background(lambda: serve.post(body)) for _ in range(8)]
        wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 7,
                   "seven requests to join the first")
        gate.touch()
        answers = [call.result() for call in calls]
        assert [a.status for a in answers] == [200] * 8
        assert metric(serve, "clef_answer_cache_total", result="coalesced") == 7
        assert metric(serve, "clef_answer_cache_joiners") == 0
        assert len({a.body for a in answers}) == 1  # one answer, handed to all eight
        assert log.read_text().split() == ["same"]  # one forward
        # A repeat with other spacing and escapes costs none.
        respaced = json.dumps(json.loads(body), indent=2, ensure_ascii=True)
        again = serve.post(respaced.encode())
        assert again.status == 200 and again.body == answers[0].body
        assert log.read_text().split() == ["same"]
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1
        assert metric(serve, "clef_answer_cache_total", result="miss") == 1
        # The same fields in another order are another request: order is part of the prompt.
        reordered = json.dumps(dict(reversed(list(json.loads(body).items()))))
        assert serve.post(reordered.encode()).status == 200
        assert log.read_text().split() == ["same", "same"]
        # A different request is computed.
        assert serve.post(clef_body(tag="other")).status == 200
        assert log.read_text().split() == ["same", "same", "other"]


def test_another_key_never_shares_an_answer(tmp_path: Path) -> None:
    keys, log = tmp_path / "keys.toml", tmp_path / "requests.log"
    keys.write_text(f'[keys.a]\nkey = "{KEY_A}"\n[keys.b]\nkey = "{KEY_B}"\n')
    body = clef_body(tag="asked")
    with Serve("--log-file", str(log), front_args=("--api-key-file", str(keys))) as serve:
        assert serve.post(body, headers=bearer(KEY_A)).status == 200
        assert serve.post(body, headers=bearer(KEY_A)).status == 200  # a's repeat: a hit
        assert serve.post(body, headers=bearer(KEY_B)).status == 200  # b: computed anew
        assert log.read_text().split() == ["asked", "asked"]
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1


def test_a_reload_keeps_the_answers_of_weights_still_served_and_zero_turns_it_off(
        tmp_path: Path) -> None:
    """A reload onto the same weights keeps what was kept (answers are bound to the weights
    that made them, not flushed by a roll); test_weights_binding.py covers other weights."""
    log, weights = tmp_path / "requests.log", tmp_path / "weights"
    weights.write_text("a" * 64)
    body = clef_body(tag="x")
    with Serve("--log-file", str(log), "--weights-file", str(weights)) as serve:
        assert serve.post(body).status == 200
        assert serve.post(body).status == 200
        assert log.read_text().split() == ["x"]
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_for(r"reload finished: 1 of 1 worker\(s\) replaced")
        kept = serve.post(body)
        assert kept.status == 200 and kept.header("clef-weights") == "a" * 16
        assert log.read_text().split() == ["x"]  # the same weights: still a hit
        assert metric(serve, "clef_answer_cache_total", result="hit") == 2
    log.unlink()
    body = clef_body(tag="y")
    # The one server here run without the cache: this test is about turning it off.
    with Serve("--log-file", str(log), answer_cache=0) as serve:
        assert [serve.post(body).status for _ in range(3)] == [200] * 3
        assert log.read_text().split() == ["y", "y", "y"]
        assert metric(serve, "clef_answer_cache_total", result="miss") == 0


def assert_one_forward_answered_and_kept(serve: Serve, log: Path, waiting: background,
                                         body: bytes) -> None:
    """Once the held forward is let go: `waiting` gets its answer, the worker computed it once,
    and it is kept (a repeat is a hit)."""
    answer = waiting.result()
    assert answer.status == 200 and answer.json()["tag"] == "shared"
    assert log.read_text().split() == ["shared"]  # one forward, not cut short
    assert serve.post(body).status == 200
    assert metric(serve, "clef_answer_cache_total", result="hit") == 1


def test_a_joiner_is_answered_as_it_would_be_alone_and_keeps_its_own_client(
        tmp_path: Path) -> None:
    """While the shared forward is held at the worker, which has room for more: an identical
    request with a 200 ms deadline runs on its own (alone it would be on the worker at once,
    its deadline moot), so sharing never turns its 200 into a 504; one without a deadline joins,
    and when its client leaves it is dropped while the forward goes on and answers the first."""
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    body = clef_body(tag="shared", hold_until=str(gate))
    with Serve("--log-file", str(log)) as serve:
        first = serve.hold_in_flight(gate, body=body)
        hurried = background(lambda: serve.post(body, headers=[("X-Clef-Deadline-Ms", "200")]))
        wait_until(lambda: hurried.done() or serve.health().json()["in_flight"] == 2,
                   "the request with a deadline on the worker", timeout=30)
        with serve.connect() as leaving:  # joins, then its client goes
            leaving.send("POST", "/v1/systemone", body)
            wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 1,
                       "the joiner")
        serve.wait_for(r"status=499 .*cache=coalesced")
        gate.touch()
        assert first.result().status == 200
        answer = hurried.result()
        assert answer.status == 200 and answer.json()["tag"] == "shared"
        assert log.read_text().split() == ["shared", "shared"]  # each computed on its own
        assert metric(serve, "clef_deadline_expired_total", **{"class": "interactive"}) == 0


def _share(cache: AnswerCache, key: bytes, gone: Callable[[], bool] = lambda: False) -> Shared:
    return cache.share(key, priority=INTERACTIVE, deadline=None, client_gone=gone)


def _answer(body: bytes) -> Answer:
    return Answer(WorkerReply(200, body, None, 1.0))


def _view(held: bool = True) -> TicketView:
    """The dispatcher's view of an admitted request; `held`: a worker holds it."""
    ticket = Ticket(1, b"{}", asyncio.get_running_loop().create_future())
    if held:
        ticket.sent(time.monotonic())
    return TicketView(ticket)


async def _wait(answer: asyncio.Future[Outcome], on_gone: Callable[[], None]) -> Outcome:
    """The connection's wait, for a client that stays."""
    return await answer


async def _never_alone() -> Outcome:
    raise AssertionError("admitted on its own")


def _no_deadline() -> None:
    raise AssertionError("no deadline was set")


async def _first_answer(cache: AnswerCache, shared: Shared) -> Outcome:
    """The first request's wait through the cache's one call (which lands its outcome)."""
    return await cache.answer(shared, _wait, _never_alone, _no_deadline)


# What the first request of a flight may come to, its HTTP status, and what a joiner that was
# already waiting is handed: only a 200 is the joiners' as it is, and the 500 of a request
# whose worker was lost twice (admitting each joiner again would let a poison request kill two
# more workers each); a refusal of the queue (503) or of the deadline (504), and a worker's
# own 500 or 422, are not: the joiner is told to go on alone.
LANDINGS = [
    (Refusal(RefusalKind.UNAVAILABLE, "worker is restarting", 1), 503, NOT_SHARED),
    (Refusal(RefusalKind.EXPIRED, EXPIRED_DETAIL), 504, NOT_SHARED),
    (Refusal(RefusalKind.EXPIRED, SHARED_EXPIRED_DETAIL), 504, NOT_SHARED),
    (_answer(b'{"ok": 4}'), 200, None),
    (Answer(WorkerReply(422, None, "questions: at least one is required", 1.0)), 422,
     NOT_SHARED),
    (Answer(WorkerReply(500, None, "inference failed", 1.0)), 500, NOT_SHARED),
    (Refusal(RefusalKind.FAILED, INFERENCE_FAILED), 500, None),
]


def test_one_caller_leaving_does_not_cancel_the_others() -> None:
    async def scenario() -> None:
        cache = AnswerCache(4)
        abandoned: list[str] = []
        key = identity("-", clef_request())
        miss = _share(cache, key)
        assert miss.how == MISS and miss.flight is not None
        flight = miss.flight
        view = _view()
        cache.admitted(miss, view, lambda _: abandoned.append("first"))
        first, second = _share(cache, key), _share(cache, key)
        assert (first.how, second.how) == (COALESCED, COALESCED) and first.flight is flight
        assert first.answer is not None and second.answer is not None
        assert cache.joiners_waiting == 2
        flight.leave(first.answer)  # a joining client went away
        assert first.answer.cancelled() and not abandoned  # the request still has callers
        assert flight.first_leaves()  # so did the first request's: it goes on for the joiner
        assert not abandoned and not flight.all_gone()  # the second joiner still waits
        view.outcome.set_result(_answer(b'{"ok": 1}'))
        assert await _first_answer(cache, miss) == _answer(b'{"ok": 1}')
        assert await cache.answer(second, _wait, _never_alone,
                                  _no_deadline) == _answer(b'{"ok": 1}')
        assert _share(cache, key).how == HIT  # kept for repeats
        gone = [False]
        other_key = identity("-", {})
        other = _share(cache, other_key, lambda: gone[0])
        assert other.flight is not None
        cache.admitted(other, _view(held=False), lambda _: abandoned.append("other"))
        mine = other.flight.join()
        other.flight.leave(mine)
        assert not abandoned  # the first request's client is still there
        gone[0] = True
        assert other.flight.all_gone()
        other.flight.leave(mine)
        assert abandoned == ["other"]  # the last caller out gives the request up

    asyncio.run(scenario())


def test_an_outcome_still_due_lands_when_it_is_set() -> None:
    """A first request whose wait ended another way (its task cancelled) leaves the landing
    to the outcome itself: the joiners still get the answer and it is kept."""
    async def scenario() -> None:
        cache = AnswerCache(4)
        key = identity("-", clef_request())
        miss = _share(cache, key, lambda: True)
        view = _view()
        cache.admitted(miss, view, lambda _: None)
        joiner = _share(cache, key)
        assert joiner.answer is not None

        async def shielded(answer: asyncio.Future[Outcome],
                           on_gone: Callable[[], None]) -> Outcome:
            return await asyncio.shield(answer)

        first = asyncio.ensure_future(cache.answer(miss, shielded, _never_alone, _no_deadline))
        await asyncio.sleep(0)  # the first request is at its wait
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert not view.outcome.done()
        assert _share(cache, key).how == COALESCED  # still in flight: others may join
        view.outcome.set_result(_answer(b'{"ok": 2}'))
        assert await joiner.answer == _answer(b'{"ok": 2}')
        assert _share(cache, key).how == HIT

    asyncio.run(scenario())


def test_identity_keeps_order_types_and_the_key() -> None:
    """Equal documents share an identity however they were spelled; another order, another
    number type or another key does not."""
    request = {**clef_request(), "questions": {"a": {"type": "noul"}, "b": {"type": "noul"}}}
    respelled = json.loads(json.dumps(request, indent=1, ensure_ascii=True))
    assert identity("-", request) == identity("-", respelled)
    reordered = {**request, "questions": dict(reversed(list(request["questions"].items())))}
    assert identity("-", reordered) != identity("-", request)
    assert identity("-", {"a": 1}) != identity("-", {"a": 1.0})
    assert identity("-", {"a": 1}) != identity("-", {"a": True})
    assert identity("rag", request) != identity("-", request)


def test_the_first_client_leaving_does_not_cut_the_forward_its_joiners_share(
        tmp_path: Path) -> None:
    """The first request's client leaves while another request waits on its forward: the
    first ends as 499, the forward goes on and answers the joiner, and the answer is kept."""
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    body = clef_body(tag="shared", hold_until=str(gate))
    with Serve("--log-file", str(log)) as serve:
        with serve.connect() as leaving:
            leaving.send("POST", "/v1/systemone", body)
            serve.wait_health(lambda h: h["in_flight"] == 1)
            joiner = background(lambda: serve.post(body))
            wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 1, "the joiner")
        serve.wait_for(r"request_id=[^-\s]\S*: client gone; its forward goes on")
        gate.touch()
        assert_one_forward_answered_and_kept(serve, log, joiner, body)
        serve.wait_for(r"status=499 .*cache=miss")


def test_kept_answers_are_bounded_in_bytes(tmp_path: Path) -> None:
    """With `--answer-cache-bytes 131072` (this test's setting; the default is 64 MiB), sixty
    distinct ~8 KB answers leave the kept bytes within the bound and above zero: the last
    request again is a hit, the first again a miss (evicted to make room)."""
    log = tmp_path / "requests.log"
    bodies = [clef_body(tag=f"{i:02d}" + "x" * 8000) for i in range(60)]
    with Serve("--log-file", str(log), front_args=("--answer-cache-bytes", "131072")) as serve:
        for body in bodies:
            response = serve.post(body)
            assert response.status == 200 and len(response.body) > 8000
        kept = metric(serve, "clef_answer_cache_bytes")
        assert 0 < kept <= 131072
        assert metric(serve, "clef_answer_cache_total", result="miss") == 60
        assert serve.post(bodies[-1]).status == 200
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1
        assert serve.post(bodies[0]).status == 200
        assert metric(serve, "clef_answer_cache_total", result="miss") == 61
        assert len(log.read_text().split()) == 61  # the first was computed again



def test_a_flight_already_answered_is_joined_only_with_a_200() -> None:
    """A flight whose outcome is set but not landed yet: a 200 is handed over at once, a refusal
    (here a 504) is not: the newcomer is a miss, admitted on its own."""
    async def scenario() -> None:
        cache = AnswerCache(4)
        for outcome, how in ((_answer(b'{"ok": 3}'), COALESCED),
                             (Refusal(RefusalKind.EXPIRED, EXPIRED_DETAIL), MISS)):
            key = identity("-", clef_request())
            view = _view(held=False)
            cache.admitted(_share(cache, key), view, lambda _: None)
            view.outcome.set_result(outcome)  # set; the first request has not landed it yet
            late = _share(cache, key)
            assert late.how == how
            if how == COALESCED:
                assert late.answer is not None and late.answer.result() == outcome

    asyncio.run(scenario())


def test_a_waiting_flight_is_joined_only_when_it_serves_the_joiner_no_worse() -> None:
    """The join rule reads the flight's own record (the first request's class and deadline, and
    the dispatcher's answer to whether a worker holds it), never the dispatcher's ticket: while
    the first request waits, an interactive request does not join a bulk one, nor one whose
    deadline comes before its own; once a worker holds it, anyone joins."""
    async def scenario() -> None:
        now = time.monotonic()
        cases = [  # (first's class, first's deadline, at a worker, joiner's class, deadline, how)
            (BULK, None, False, INTERACTIVE, None, MISS),
            (BULK, None, False, BULK, None, COALESCED),
            (INTERACTIVE, None, False, BULK, None, COALESCED),
            (INTERACTIVE, now + 5, False, INTERACTIVE, now + 60, MISS),
            (INTERACTIVE, now + 60, False, INTERACTIVE, now + 5, COALESCED),
            (INTERACTIVE, now + 5, False, INTERACTIVE, None, MISS),
            (BULK, now + 5, True, INTERACTIVE, now + 60, COALESCED),
        ]
        for first_class, first_deadline, held, joiner_class, joiner_deadline, how in cases:
            cache = AnswerCache(4)
            key = identity("-", clef_request())
            first = cache.share(key, priority=first_class, deadline=first_deadline,
                                client_gone=lambda: False)
            assert first.how == MISS and first.flight is not None
            assert (first.flight.priority, first.flight.deadline) == (first_class,
                                                                      first_deadline)
            assert cache.share(key, priority=joiner_class, deadline=joiner_deadline,
                               client_gone=lambda: False).how == MISS  # not admitted yet
            cache.admitted(first, _view(held), lambda _: None)
            late = cache.share(key, priority=joiner_class, deadline=joiner_deadline,
                               client_gone=lambda: False)
            assert late.how == how, (first_class, first_deadline, held, joiner_class,
                                     joiner_deadline)

    asyncio.run(scenario())


@pytest.mark.parametrize(("outcome", "status", "handed"), LANDINGS,
                         ids=[str(status) for _, status, _ in LANDINGS])
def test_a_waiting_joiner_gets_the_shared_answer_but_never_a_503_or_504(
        outcome: Outcome, status: int, handed: Refusal | None) -> None:
    """A joiner already waiting when the first request lands: it is handed a 200 and a FAILED
    500 as they are; for anything else (a 503, a 504, a worker's own 500 or 422) it is told
    `NOT_SHARED` (never shown to a client) and the cache's call admits it on its own. Only the
    200 is kept."""
    assert from_outcome(outcome).status == status

    async def scenario() -> None:
        cache = AnswerCache(4)
        key = identity("-", clef_request())
        miss = _share(cache, key)
        view = _view()
        cache.admitted(miss, view, lambda _: None)
        joiner = _share(cache, key)
        assert joiner.how == COALESCED and joiner.answer is not None
        alone = _answer(b'{"alone": 1}')
        admitted_alone: list[bool] = []

        async def on_its_own() -> Outcome:
            admitted_alone.append(True)
            return alone

        waiting = asyncio.ensure_future(cache.answer(joiner, _wait, on_its_own, _no_deadline))
        await asyncio.sleep(0)  # waiting before the first request's outcome is set
        assert not joiner.answer.done()
        view.outcome.set_result(outcome)
        assert await _first_answer(cache, miss) is outcome
        received = await waiting
        assert cache.joiners_waiting == 0
        if handed is NOT_SHARED:
            assert joiner.answer.result() is NOT_SHARED
            assert received is alone and admitted_alone == [True]
        else:
            assert received is outcome and not admitted_alone
        assert _share(cache, key).how == (HIT if status == 200 else MISS)

    asyncio.run(scenario())


def test_a_kept_answer_is_served_only_while_its_model_is_served_with_its_weights() -> None:
    """The one rule: a kept answer records the model and weights that made it, and is a hit
    only while a ready worker serves that model with those weights (`serving`, here a set the
    test changes as workers would); one found stale is dropped, and `prune` drops them all."""
    async def scenario() -> None:
        served = {("tiny-alpha", "w1"), ("", "b1")}
        cache = AnswerCache(8, serving=lambda model, weights: (model, weights) in served)

        async def keep(request: dict[str, Any], model: str, weights: str) -> bytes:
            key = identity("-", request)
            miss = cache.share(key, priority=INTERACTIVE, deadline=None,
                               client_gone=lambda: False, model=model)
            view = _view()
            cache.admitted(miss, view, lambda _: None)
            view.outcome.set_result(Answer(WorkerReply(200, b"{}", None, 1.0, weights=weights)))
            await _first_answer(cache, miss)  # landed: kept
            return key

        variant = await keep(clef_request(model="tiny-alpha"), "tiny-alpha", "w1")
        base = await keep(clef_request(tag="base"), "", "b1")
        other = await keep(clef_request(tag="other"), "", "b1")
        assert [_share(cache, key).how for key in (variant, base, other)] == [HIT] * 3
        # The same weights under another model's name are not that model's.
        served.discard(("tiny-alpha", "w1"))
        served.add(("tiny-beta", "w1"))
        assert _share(cache, variant).how == MISS
        assert len(cache) == 2  # found stale: dropped
        served.discard(("", "b1"))  # every worker now runs other base weights
        served.add(("", "b2"))
        assert cache.prune() == 2 and len(cache) == 0 and cache.size_bytes == 0
        assert _share(cache, base).how == MISS

    asyncio.run(scenario())

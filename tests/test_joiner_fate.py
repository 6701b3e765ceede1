"""Sharing an identical request's forward never changes what a request gets: a joiner gets what
it would have got alone. A forward on a worker that a roll retired is not joined (its answer,
of weights no worker serves now, is that request's only), and a landing of such weights hands
its joiners nothing; a joiner's own deadline is judged as its own ticket's would be (never while
a worker holds the forward). Over HTTP with the fake worker (`--weights-file` stands for the
weights), then the cache's rules on their own."""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections.abc import Callable
from pathlib import Path

from clef_dispatch import INTERACTIVE, Answer, Outcome, RefusalKind
from clef_dispatch.ticket import Ticket, TicketView
from clef_frontend.answer_cache import COALESCED, HIT, MISS, NOT_SHARED, AnswerCache, identity
from clef_protocol.messages import WorkerReply
from tests.frontend_helpers import Serve, background, clef_body, clef_request
from tests.traffic_helpers import metric, wait_until

OLD, NEW = "a" * 64, "b" * 64


def _fingerprints(health: dict[str, object]) -> set[str]:
    workers = health["workers"]
    assert isinstance(workers, list)
    return {fingerprint for worker in workers for fingerprint in worker["models"].values()}


def test_a_request_never_joins_a_forward_of_weights_a_roll_retired(tmp_path: Path) -> None:
    """A request held on the worker; the weights are replaced and SIGHUP rolls; once /health
    shows the new weights an identical request runs on the new worker (not on the retiring
    worker's forward), the held one still gets its own worker's answer, and only the new
    weights' answer is kept. `--shutdown-grace 60` (this test's setting): the retiring worker
    keeps its held request until the test lets it go."""
    gate, weights = tmp_path / "gate", tmp_path / "weights"
    weights.write_text(OLD)
    body = clef_body(tag="rolled", hold_until=str(gate))
    with Serve("--weights-file", str(weights), front_args=("--shutdown-grace", "60")) as serve:
        first = serve.hold_in_flight(gate, body=body)
        weights.write_text(NEW)
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_health(lambda h: _fingerprints(h) == {NEW})
        second = background(lambda: serve.post(body))
        wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 1
                   or serve.health().json()["in_flight"] == 2, "the identical request")
        gate.touch()
        assert first.result().header("Clef-Weights") == OLD[:16]  # the worker it was on
        answer = second.result()
        assert answer.status == 200 and answer.header("Clef-Weights") == NEW[:16]
        serve.wait_for(r"reload finished: 1 of 1 worker\(s\) replaced")
        again = serve.post(body)
        assert again.header("Clef-Weights") == NEW[:16]
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1
        assert metric(serve, "clef_answer_cache_total", result="coalesced") == 0


def test_a_joiners_deadline_passing_while_the_forward_is_on_a_worker_costs_it_nothing(
        tmp_path: Path) -> None:
    """`--max-batch 1` (this test's setting: no worker has room, so the request with a deadline
    joins): its 300 ms pass while the shared forward is on the worker (a later request with the
    same deadline, waiting for a worker, gets its 504 first), yet it gets the shared 200, as
    it would have alone once on a worker."""
    gate = tmp_path / "gate"
    body = clef_body(tag="shared", hold_until=str(gate))
    deadline = [("X-Clef-Deadline-Ms", "300")]
    with Serve(max_batch=1) as serve:
        first = serve.hold_in_flight(gate, body=body)
        joiner = background(lambda: serve.post(body, headers=deadline))
        wait_until(lambda: metric(serve, "clef_answer_cache_joiners") == 1, "the joiner")
        later = serve.post(clef_body(tag="later"), headers=deadline)  # waits: no room
        assert (later.status, later.detail) == (504, "deadline passed before a worker was free")
        gate.touch()
        assert first.result().status == 200
        answer = joiner.result()
        assert answer.status == 200 and answer.json()["tag"] == "shared"
        assert metric(serve, "clef_answer_cache_total", result="coalesced") == 1


# -- the rules, without a server -------------------------------------------------------------

def _view(weights: str | None, held: bool = True) -> TicketView:
    ticket = Ticket(1, b"{}", asyncio.get_running_loop().create_future(), weights=weights)
    if held:
        ticket.sent(time.monotonic())
    return TicketView(ticket)


async def _wait(answer: asyncio.Future[Outcome], on_gone: Callable[[], None]) -> Outcome:
    return await answer


def _always(answer: bool, model: str) -> bool:
    return answer


def _served(*weights: str) -> Callable[[str, str], bool]:
    return lambda model, fingerprint: fingerprint in weights


def test_a_forward_on_retired_weights_is_not_joined() -> None:
    async def scenario() -> None:
        for on, how in ((OLD, MISS), (NEW, COALESCED)):
            cache = AnswerCache(4, serving=_served(NEW))
            key = identity("-", clef_request())
            first = cache.share(key, priority=INTERACTIVE, deadline=None,
                                client_gone=lambda: False)
            cache.admitted(first, _view(on), lambda _: None)
            assert cache.share(key, priority=INTERACTIVE, deadline=None,
                               client_gone=lambda: False).how == how

    asyncio.run(scenario())


def test_a_landing_of_retired_weights_is_handed_to_nobody_else_nor_kept() -> None:
    async def scenario() -> None:
        served = {OLD}
        cache = AnswerCache(4, serving=lambda model, fingerprint: fingerprint in served)
        key = identity("-", clef_request())
        first = cache.share(key, priority=INTERACTIVE, deadline=None, client_gone=lambda: False)
        view = _view(OLD)
        cache.admitted(first, view, lambda _: None)
        joiner = cache.share(key, priority=INTERACTIVE, deadline=None, client_gone=lambda: False)
        assert joiner.how == COALESCED and joiner.answer is not None
        alone = Answer(WorkerReply(200, b'{"alone": 1}', None, 1.0, weights=NEW))

        async def on_its_own() -> Outcome:
            return alone

        waiting = asyncio.ensure_future(cache.answer(joiner, _wait, on_its_own, lambda: None))
        served.discard(OLD)  # the roll: no ready worker serves the old weights now
        served.add(NEW)
        old = Answer(WorkerReply(200, b'{"old": 1}', None, 1.0, weights=OLD))
        view.outcome.set_result(old)
        assert await cache.answer(first, _wait, on_its_own, lambda: None) is old  # its own
        assert await waiting is alone and joiner.answer.result() is NOT_SHARED
        assert len(cache) == 0
        assert cache.share(key, priority=INTERACTIVE, deadline=None,
                           client_gone=lambda: False).how == MISS

    asyncio.run(scenario())


def test_a_joiner_with_a_deadline_runs_alone_when_a_worker_would_take_it_now() -> None:
    async def scenario() -> None:
        for takes_now, how in ((True, MISS), (False, COALESCED)):
            cache = AnswerCache(4, takes_now=functools.partial(_always, takes_now))
            key = identity("-", clef_request())
            first = cache.share(key, priority=INTERACTIVE, deadline=None,
                                client_gone=lambda: False)
            cache.admitted(first, _view(""), lambda _: None)
            hurried = cache.share(key, priority=INTERACTIVE, deadline=time.monotonic() + 0.3,
                                  client_gone=lambda: False)
            assert hurried.how == how
            # Without a deadline of its own a request joins either way (one forward, not two).
            assert cache.share(key, priority=INTERACTIVE, deadline=None,
                               client_gone=lambda: False).how == COALESCED

    asyncio.run(scenario())


def test_a_joiner_whose_forward_still_waits_for_a_worker_expires_at_its_deadline() -> None:
    async def scenario() -> None:
        cache = AnswerCache(4)
        key = identity("-", clef_request())
        soon = time.monotonic() + 0.05
        first = cache.share(key, priority=INTERACTIVE, deadline=soon + 60,
                            client_gone=lambda: False)
        view = _view("", held=False)  # waiting in the queue
        cache.admitted(first, view, lambda _: None)
        joiner = cache.share(key, priority=INTERACTIVE, deadline=soon, client_gone=lambda: False)
        assert joiner.how == COALESCED
        told: list[bool] = []

        async def never() -> Outcome:
            raise AssertionError("admitted on its own")

        refused = await cache.answer(joiner, _wait, never, lambda: told.append(True))
        assert not isinstance(refused, Answer) and refused.kind is RefusalKind.EXPIRED
        assert told == [True] and not view.outcome.done()  # the forward goes on
        view.outcome.set_result(Answer(WorkerReply(200, b"{}", None, 1.0)))
        await cache.answer(first, _wait, never, lambda: None)
        assert cache.share(key, priority=INTERACTIVE, deadline=None,
                           client_gone=lambda: False).how == HIT

    asyncio.run(scenario())

"""The request pipeline and the HTTP/1.1 session, driven without a socket.

`Http1Session` is fed bytes and asked for events; the pipeline's steps are run on a context
whose I/O (body bytes, the wait for the worker) is a test double, with the real admission
queue, metrics and API surface behind them. A worker is a lane the test answers by hand.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from clef_api import responses, workers_ai
from clef_api.catalogue import Catalogue
from clef_api.checks import RequestRules
from clef_api.responses import Reply
from clef_api.routes import Route
from clef_dispatch import Outcome, WorkerSettings
from clef_dispatch.worker_errors import Deliver
from clef_frontend.config import ServerConfig
from clef_frontend.http1 import BODY_END, Http1Session, Need, RefusedHead, RequestHead
from clef_frontend.metrics import LiveState, Metrics
from clef_frontend.pipeline import ClientGone, Pipeline, RequestContext
from clef_protocol.messages import Request, WorkerReply
from clef_protocol.options import RequestLimits
from clef_tools.batch_input import Job
from clef_tools.screening import Screen, finish
from tests.doubles import Admission, Door, FakeLane, FakeWorkers

BODY = json.dumps({"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}).encode()
RUN = "/accounts/acct-1/ai/run/@cf/cloudflare/clef-flash"


def raw_request(method: str, target: str, body: bytes = b"", *headers: str) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: t", *headers]
    if method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def parse_head(raw: bytes) -> tuple[Http1Session, RequestHead]:
    session = Http1Session(16 * 1024)
    session.receive(raw)
    head = session.next_head()
    assert isinstance(head, RequestHead)
    return session, head


class FakeIO:
    """The connection's side of the pipeline: a body given up front, a client that stays (or
    leaves the moment the pipeline starts waiting for the worker)."""

    def __init__(self, body: bytes | Reply = b"", *, client_leaves: bool = False) -> None:
        self.body = body
        self.client_leaves = client_leaves
        self.body_reads: list[int] = []
        self.skipped = False
        self.gone = False

    async def read_body(self, length: int) -> bytes | Reply:
        self.body_reads.append(length)
        return self.body

    def skip_body(self) -> None:
        self.skipped = True

    def client_gone(self) -> bool:
        return self.gone

    async def wait_answer(
        self, answer: asyncio.Future[Outcome], on_gone: Callable[[], None]
    ) -> Outcome:
        if self.client_leaves:
            on_gone()
            raise ClientGone
        return await answer


class Health:
    def reply(self) -> Reply:
        return responses.document(200, {"status": "ready"})


class SignallingLane(FakeLane):
    """A FakeLane that says when a request reaches it."""

    def __init__(self, room: int) -> None:
        super().__init__(room)
        self.reached = asyncio.Event()

    def submit(self, request: Request, deliver: Deliver) -> None:
        super().submit(request, deliver)
        self.reached.set()


class Rig:
    """A pipeline over the real admission and metrics, with one hand-answered lane."""

    def __init__(self, room: int = 1) -> None:
        self.lane = SignallingLane(room)
        self.admission = Admission(capacity=4, retry_after=1, workers=FakeWorkers(self.lane))
        self.metrics = Metrics(LiveState(
            queue_depth=self.admission.depth_of, in_flight=lambda: self.admission.in_flight,
            queue_capacity=4, worker_ready=lambda: True, worker_info=lambda: None,
        ), version="test")
        self.pipeline = Pipeline(config=ServerConfig(WorkerSettings(("unused",))),
                                 dispatch=Door(self.admission), health=Health(),
                                 metrics=self.metrics)

    def context(self, method: str, target: str, body: bytes = b"", *headers: str,
                io: FakeIO | None = None) -> RequestContext:
        _, head = parse_head(raw_request(method, target, body, *headers))
        return RequestContext.of(head, io or FakeIO(body))

    async def serve(self, ctx: RequestContext) -> Reply | None:
        """The whole request as the connection runs it: answered, in its form, counted."""
        return await self.pipeline.answer(ctx)

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def at_its_wait(ctx: RequestContext) -> bool:
    """The request was admitted (its own ticket), or shares an answer already coming (a hit,
    a joiner): its next step awaits the answer."""
    return ctx.ticket is not None or (ctx.shared is not None and ctx.shared.admitted_elsewhere)


async def answered_by_lane(rig: Rig, ctx: RequestContext) -> Reply | None:
    """Serve `ctx` while the lane answers the request it receives."""
    rig.lane.reached.clear()
    task = asyncio.ensure_future(rig.serve(ctx))
    reached = asyncio.ensure_future(rig.lane.reached.wait())
    await asyncio.wait({task, reached}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
    reached.cancel()
    if rig.lane.held:
        _, deliver = rig.lane.held.pop(0)
        deliver(WorkerReply(200, b'{"answers": 1}', None, 12.0, input_tokens=40,
                            truncated_tokens=3, batch_size=2))
    return await asyncio.wait_for(task, 10)


def test_session_keeps_the_raw_framing_of_each_pipelined_head() -> None:
    first = raw_request("POST", "/v1/systemone", BODY)
    second = raw_request("GET", "/health")
    session, head = parse_head(first + second)
    assert head.framing.content_lengths == (str(len(BODY)).encode(),)
    assert head.header(b"content-type") == b"application/json"
    assert session.next_body_event() == BODY
    assert session.next_body_event() is BODY_END
    frame = session.frame(Reply(200, b"{}"), method=b"POST", close=False, extra=[])
    assert frame is not None and frame.startswith(b"HTTP/1.1 200 OK\r\n")
    assert session.start_next_cycle()
    assert session.head_begun  # the pipelined head is already buffered
    nxt = session.next_head()
    assert isinstance(nxt, RequestHead) and nxt.request.target == b"/health"
    assert nxt.size == len(second)


def test_session_refuses_a_malformed_head_with_its_target() -> None:
    session = Http1Session(16 * 1024)
    session.receive(b"POST " + RUN.encode() + b" HTTP/1.1\r\nBad Header\r\n\r\n")
    refused = session.next_head()
    assert isinstance(refused, RefusedHead)
    assert refused.reply.status == 400 and refused.target == RUN.encode()


def test_session_closes_after_an_answer_given_before_the_body() -> None:
    session, _ = parse_head(raw_request("POST", "/v1/systemone", BODY)[:-5])
    frame = session.frame(Reply(413, b"{}"), method=b"POST", close=False, extra=[])
    assert frame is not None and b"Connection: close" in frame
    assert session.client_may_be_sending
    assert not session.start_next_cycle()
    empty = Http1Session(16 * 1024)
    assert empty.next_head() is Need.DATA


def test_a_valid_request_goes_through_every_step_to_the_worker() -> None:
    async def scenario() -> None:
        rig = Rig()
        ctx = rig.context("POST", "/v1/systemone", BODY, "X-Request-Id: abc-1")
        reply = await answered_by_lane(rig, ctx)
        assert reply is not None and (reply.status, reply.body) == (200, b'{"answers": 1}')
        assert rig.lane.sent == [BODY]
        assert ctx.route is Route.SYSTEMONE and ctx.request_id == "abc-1"
        assert ctx.bytes_in == len(BODY)
        assert dict(ctx.trace_headers())["X-Request-Id"] == "abc-1"
        assert "worker;dur=12.0" in dict(ctx.trace_headers())["Server-Timing"]

    asyncio.run(scenario())


@pytest.mark.parametrize(("body", "status"), [(b"{", 400), (b'{"state": 1}', 422)])
def test_a_bad_body_is_refused_before_admission(body: bytes, status: int) -> None:
    async def scenario() -> None:
        rig = Rig()
        reply = await rig.serve(rig.context("POST", "/v1/systemone", body))
        assert reply is not None and reply.status == status
        assert rig.lane.sent == [] and rig.admission.depth == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(("stage", "reads_body"), [
    ("check_target", False), ("check_head", False), ("check_body", True)])
def test_a_refusal_added_to_a_stage_reaches_both_drivers(
    monkeypatch: pytest.MonkeyPatch, stage: str, reads_body: bool
) -> None:
    """Both drivers run `RequestRules`' stages and nothing else: a refusal added to one stage is
    given, byte for byte, by the front's pipeline and by clef-batch's screening, and the front
    still reads no body byte for a refusal decided before the body stage."""
    job = Job(1, "a", RUN.encode(), BODY)
    screen = Screen(RequestRules(RequestLimits(), Catalogue(("clef-flash",))))
    assert screen.refuse(job) is None  # without the new rule, both would forward it
    added = responses.error(451, f"refused by a rule added to {stage}")
    monkeypatch.setattr(RequestRules, stage, lambda self, *args: added)

    async def front() -> tuple[Reply | None, FakeIO]:
        rig = Rig()
        io = FakeIO(BODY)
        # Bounded: a stage the front skipped would send the request on to the held lane.
        reply = await asyncio.wait_for(rig.serve(rig.context("POST", RUN, BODY, io=io)), 10)
        assert rig.lane.sent == [] and rig.admission.depth == 0
        return reply, io

    reply, io = asyncio.run(front())
    batch = screen.refuse(job)
    assert batch is added
    assert reply is not None and (reply.status, reply.body) == (451, finish(job, batch).body)
    assert b"refused by a rule added to " + stage.encode() in reply.body
    assert io.body_reads == ([len(BODY)] if reads_body else [])


def test_a_body_that_fails_to_arrive_ends_the_request_before_validation() -> None:
    async def scenario() -> None:
        rig = Rig()
        slow = responses.error(408, "request body timed out", close=True)
        ctx = rig.context("POST", "/v1/systemone", BODY, io=FakeIO(slow))
        assert await rig.serve(ctx) is slow
        assert ctx.body is None and rig.lane.sent == []

    asyncio.run(scenario())


def test_bodyless_routes_answer_from_the_head_and_skip_the_body() -> None:
    async def scenario() -> None:
        rig = Rig()
        for method, target, status, label in [
            ("GET", "/health", 200, "/health"),
            ("GET", "/nowhere", 404, "unknown"),
            ("POST", "/health", 405, "/health"),
            ("GET", "/v1/models", 200, "/v1/models"),
        ]:
            io = FakeIO()
            ctx = rig.context(method, target, io=io)
            reply = await rig.serve(ctx)
            assert reply is not None and reply.status == status, target
            assert io.skipped and io.body_reads == [] and ctx.route_label == label
        assert rig.lane.sent == []

    asyncio.run(scenario())


def test_a_client_that_leaves_takes_its_ticket_out_of_the_queue() -> None:
    async def scenario() -> None:
        rig = Rig(room=0)  # the worker has no room: the request waits in the queue
        ctx = rig.context("POST", "/v1/systemone", BODY, io=FakeIO(BODY, client_leaves=True))
        assert await rig.serve(ctx) is None
        assert rig.admission.depth == 0 and rig.lane.sent == []
        assert rig.sample("clef_http_requests_total", route="/v1/systemone", status="499",
                          key="-") == 1

    asyncio.run(scenario())


def test_the_steps_are_one_list_in_contract_order() -> None:
    """The rig runs the list the server runs: the pipeline declares it, traffic steps and
    sharing included, and nothing splices steps in afterwards."""
    rig = Rig()
    assert [step.__name__ for step in rig.pipeline.steps] == [
        "check_head_size", "route", "decide_from_head", "identify", "check_quota", "classify",
        "set_deadline",
        "check_post_head", "read_body", "validate", "share", "admit", "await_answer"]
    assert rig.pipeline.cache.enabled  # the server's default: the answer cache is on


def test_a_hit_and_a_joiner_take_the_same_steps_and_leave_the_same_traces() -> None:
    async def scenario() -> None:
        rig = Rig(room=2)
        first = rig.context("POST", "/v1/systemone", BODY)
        joiner = rig.context("POST", "/v1/systemone", BODY)
        owner = asyncio.ensure_future(rig.serve(first))
        await rig.lane.reached.wait()
        joined = asyncio.ensure_future(rig.serve(joiner))
        while not at_its_wait(joiner):  # the joiner reaches its wait without a second frame
            await asyncio.sleep(0)
        _, deliver = rig.lane.held.pop(0)
        deliver(WorkerReply(200, b'{"answers": 1}', None, 12.0, input_tokens=40,
                            truncated_tokens=0, batch_size=1))
        replies = [await owner, await joined]
        hit = rig.context("POST", "/v1/systemone", BODY)
        replies.append(await rig.serve(hit))
        assert [r.body for r in replies if r is not None] == [b'{"answers": 1}'] * 3
        assert rig.lane.sent == [BODY]  # one forward for three requests
        assert (first.cache, joiner.cache, hit.cache) == ("miss", "coalesced", "hit")
        timing = [dict(ctx.trace_headers())["Server-Timing"] for ctx in (first, joiner, hit)]
        assert timing[0].startswith("queue;dur=") and "worker;dur=12.0" in timing[0]
        assert timing[1].startswith("cache;desc=coalesced, total;dur=")
        assert timing[2].startswith("cache;desc=hit, total;dur=")
        assert rig.sample("clef_http_requests_total", route="/v1/systemone", status="200",
                          key="-") == 3
        assert rig.sample("clef_request_duration_seconds_count") == 3
        assert rig.sample("clef_request_worker_seconds_count") == 1  # one forward measured
        for result in ("miss", "coalesced", "hit"):
            assert rig.sample("clef_answer_cache_total", result=result) == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("target", ["/v1/systemone", RUN])
def test_scoring_requests_are_measured_on_both_routes(target: str) -> None:
    async def scenario() -> None:
        rig = Rig()
        ctx = rig.context("POST", target, BODY)
        reply = await answered_by_lane(rig, ctx)
        assert reply is not None and reply.status == 200
        if target == RUN:
            assert json.loads(reply.body)["result"] == {"answers": 1}
        label = target if target != RUN else workers_ai.PATH_TEMPLATE
        assert rig.sample("clef_http_requests_total", route=label, status="200", key="-") == 1
        assert rig.sample("clef_request_duration_seconds_count") == 1
        assert rig.sample("clef_request_queue_seconds_count", **{"class": "interactive"}) == 1
        assert rig.sample("clef_request_worker_seconds_count") == 1
        assert rig.sample("clef_request_input_tokens_sum") == 40
        assert rig.sample("clef_request_batch_size_sum") == 2

    asyncio.run(scenario())


def test_routes_that_are_not_scored_stay_out_of_the_latency_histograms() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.serve(rig.context("GET", "/health"))
        await rig.serve(rig.context("GET", "/v1/models"))
        assert rig.sample("clef_request_duration_seconds_count") == 0
        assert [r for r in Route if r.is_scoring] == [Route.SYSTEMONE, Route.WORKERS_AI]

    asyncio.run(scenario())


def test_a_repeat_is_refused_like_any_new_request_while_draining() -> None:
    async def scenario() -> None:
        rig = Rig()
        first = await answered_by_lane(rig, rig.context("POST", "/v1/systemone", BODY))
        assert first is not None and first.status == 200
        rig.admission.start_draining()
        repeat = rig.context("POST", "/v1/systemone", BODY)
        refused = await rig.serve(repeat)
        assert refused is not None and refused.status == 503
        assert json.loads(refused.body) == {"detail": "server is draining"}
        assert repeat.cache == "hit" and rig.lane.sent == [BODY]
        assert "Server-Timing" not in dict(repeat.trace_headers())  # refused, not answered

    asyncio.run(scenario())


def test_a_queued_request_is_joined_only_by_requests_it_cannot_make_wait_longer() -> None:
    """Joining a request still in the queue means waiting in its class and to its deadline:
    a request without a deadline does not join one with a deadline, nor an interactive
    request a bulk one; each is admitted on its own. Joining the other way round is fine."""
    other = json.dumps({"model": "m", "state": "other", "questions": {"q": {"type": "noul"}}})

    async def scenario() -> None:
        rig = Rig(room=0)  # the worker has no room: every admitted request waits in the queue
        contexts = [
            rig.context("POST", "/v1/systemone", BODY, "X-Clef-Deadline-Ms: 60000"),
            rig.context("POST", "/v1/systemone", BODY),  # no deadline: not behind one
            rig.context("POST", "/v1/systemone", BODY, "X-Clef-Deadline-Ms: 30000"),
            rig.context("POST", "/v1/systemone", BODY, "X-Clef-Priority: bulk"),
            rig.context("POST", "/v1/systemone", other.encode(), "X-Clef-Priority: bulk"),
            rig.context("POST", "/v1/systemone", other.encode()),  # interactive: not behind bulk
        ]
        tasks = []
        for ctx in contexts:
            tasks.append(asyncio.ensure_future(rig.serve(ctx)))
            while not at_its_wait(ctx):  # each reaches its wait before the next one arrives
                await asyncio.sleep(0)
        assert [ctx.cache for ctx in contexts] == [
            "miss", "miss", "coalesced", "coalesced", "miss", "miss"]
        flights = [ctx.shared.flight if ctx.shared else None for ctx in contexts]
        assert flights[2] is flights[3] is flights[1]
        assert rig.admission.depth == 4
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_joiner_is_admitted_on_its_own_when_the_shared_request_is_refused() -> None:
    """The request a joiner shares is refused while queued (503: here the queue is refused as
    when the last worker is lost): the first request gets its 503, the joiner, which was never
    refused itself, is admitted on its own and answered by the worker."""
    async def scenario() -> None:
        rig = Rig(room=0)  # no room yet: both wait in the queue
        first = rig.context("POST", "/v1/systemone", BODY)
        joiner = rig.context("POST", "/v1/systemone", BODY)
        tasks = []
        for ctx in (first, joiner):
            tasks.append(asyncio.ensure_future(rig.serve(ctx)))
            while not at_its_wait(ctx):  # each reaches its wait before the next one arrives
                await asyncio.sleep(0)
        assert (first.cache, joiner.cache) == ("miss", "coalesced")
        rig.admission.refuse_waiting("worker is restarting")
        refused = await tasks[0]
        assert refused is not None and refused.status == 503
        while rig.admission.depth == 0:  # the joiner queues again, on its own
            await asyncio.sleep(0)
        rig.lane.room = 1
        rig.admission.pump()
        _, deliver = rig.lane.held.pop(0)
        deliver(WorkerReply(200, b'{"answers": 1}', None, 12.0))
        answered = await asyncio.wait_for(tasks[1], 10)
        assert answered is not None and answered.status == 200
        # It did its own forward: a miss, not coalesced (the lookup counter says how each
        # request's answer came).
        assert joiner.cache == "miss"
        assert rig.sample("clef_answer_cache_total", result="miss") == 2
        assert rig.sample("clef_answer_cache_total", result="coalesced") == 0
        assert answered.body == b'{"answers": 1}'

    asyncio.run(scenario())


def test_a_workers_500_is_the_first_requests_alone_and_its_joiner_is_answered_on_its_own(
) -> None:
    """The worker answers the shared request with its own 500 (transient: a failing forward):
    the first request gets it, the joiner is admitted on its own and gets the next forward's
    200; the 500 is not kept, and the joiner counts as a miss."""
    async def scenario() -> None:
        rig = Rig(room=1)
        first = rig.context("POST", "/v1/systemone", BODY)
        joiner = rig.context("POST", "/v1/systemone", BODY)
        tasks = []
        for ctx in (first, joiner):
            tasks.append(asyncio.ensure_future(rig.serve(ctx)))
            while not at_its_wait(ctx):
                await asyncio.sleep(0)
        assert (first.cache, joiner.cache) == ("miss", "coalesced")
        rig.lane.reached.clear()
        _, deliver = rig.lane.held.pop(0)
        deliver(WorkerReply(500, None, "inference failed", 3.0))
        failed = await tasks[0]
        assert failed is not None and failed.status == 500
        await asyncio.wait_for(rig.lane.reached.wait(), 10)  # the joiner's own forward
        _, deliver = rig.lane.held.pop(0)
        deliver(WorkerReply(200, b'{"answers": 2}', None, 12.0))
        answered = await asyncio.wait_for(tasks[1], 10)
        assert answered is not None and (answered.status, answered.body) == (200,
                                                                           b'{"answers": 2}')
        assert rig.lane.sent == [BODY, BODY]
        assert (first.cache, joiner.cache) == ("miss", "miss")
        assert rig.sample("clef_answer_cache_total", result="coalesced") == 0
        assert rig.sample("clef_answer_cache_total", result="miss") == 2
        assert len(rig.pipeline.cache) == 0  # the 500 is never kept

    asyncio.run(scenario())

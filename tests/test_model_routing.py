"""A request goes only to a worker that serves the model it names (the real queue,
hand-answered lanes): while workers disagree about a fine-tuned variant (a rolling restart that
adds or removes one), a variant's request waits for a worker that has it, base requests go to
any, and a variant no ready worker serves is refused 503 with Retry-After, never sent to a
worker that would score it as another model."""

from __future__ import annotations

import asyncio

from clef_dispatch import Refusal
from clef_dispatch import admission as admission_module
from tests.doubles import Admission, FakeLane, FakeWorkers, reply_of


def test_a_variant_goes_only_to_the_workers_that_serve_it() -> None:
    async def scenario() -> None:
        plain, tuned = FakeLane(room=4), FakeLane(room=4, variants=("tiny-alpha",))
        admission = Admission(capacity=16, retry_after=1, workers=FakeWorkers(plain, tuned))
        tickets = [admission.submit(f"v{i}".encode(), model="tiny-alpha") for i in range(3)]
        base = [admission.submit(f"b{i}".encode()) for i in range(4)]
        assert tuned.sent[:3] == [b"v0", b"v1", b"v2"]
        assert b"v0" not in plain.sent and sorted(plain.sent + tuned.sent[3:]) == [
            b"b0", b"b1", b"b2", b"b3"]
        # The tuned worker is full: the next variant request waits for it even though the other
        # worker has room, and what arrives after it waits behind it (FIFO within a class).
        assert len(tuned.held) == 4 and len(plain.held) == 3
        waiting = admission.submit(b"v3", model="tiny-alpha")
        later = admission.submit(b"b4")
        assert admission.depth == 2 and b"v3" not in plain.sent + tuned.sent
        tuned.answer_oldest()
        assert tuned.sent[-1] == b"v3" and plain.sent[-1] == b"b4"
        assert admission.depth == 0
        while tuned.held:
            tuned.answer_oldest()
        while plain.held:
            plain.answer_oldest()
        for ticket in [*tickets, *base, waiting, later]:
            reply = await reply_of(ticket)
            assert reply.status == 200 and reply.body == ticket.body

    asyncio.run(scenario())


def test_a_variant_no_ready_worker_serves_is_503_never_sent() -> None:
    async def scenario() -> None:
        plain, tuned = FakeLane(room=1), FakeLane(room=1, variants=("tiny-alpha",))
        admission = Admission(capacity=16, retry_after=3, workers=FakeWorkers(plain, tuned))
        held = admission.submit(b"held", model="tiny-alpha")  # fills the tuned worker
        queued = admission.submit(b"queued", model="tiny-alpha")
        assert admission.depth == 1
        tuned.ready = False  # its worker is restarting: nobody ready serves the variant now
        admission.pump()
        refused = await reply_of(queued)
        assert refused.status == 503 and refused.retry_after == 3
        assert refused.detail == "no ready worker serves model 'tiny-alpha' now"
        at_once = admission_module.Admission.submit(admission, b"new", model="tiny-alpha")
        assert isinstance(at_once, Refusal)
        assert at_once.detail == "no ready worker serves model 'tiny-alpha' now"
        base = admission.submit(b"base")
        plain.answer_oldest()
        assert (await reply_of(base)).body == b"base"
        assert plain.sent == [b"base"]  # the base worker never saw a variant's request
        assert not held.outcome.done()  # the one already on its worker is still its own

    asyncio.run(scenario())

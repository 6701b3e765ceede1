"""Replies are matched to requests by id, never by order; a reply for no request breaks the
channel. Driven through the real `WorkerChannel` against a scripted worker process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from clef_dispatch.worker_channel import WorkerChannel, WorkerProtocolError
from clef_dispatch.worker_errors import Deliver, WorkerFailure, WorkerOutcome
from clef_protocol.messages import Request, WorkerReply

REPO = Path(__file__).resolve().parent.parent

# Sends `ready`, reads three requests, then answers them as the script's last line says, each
# reply's body naming the id it answers.
PREAMBLE = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from clef_protocol import messages
from clef_protocol.frames import encode_frame, read_frame_blocking
inp, out = sys.stdin.buffer, sys.stdout.buffer
out.write(encode_frame(messages.ready(messages.ReadyInfo(
    pid=0, thread="main", model="scripted", variant="v", device="cpu", dtype="float32",
    gdn_path="none"))))
out.flush()
ids = [read_frame_blocking(inp)["id"] for _ in range(3)]
def reply(i):
    return encode_frame(messages.response(i, b'{{"answers": %d}}' % i, 0.0))
"""
REVERSED = PREAMBLE + "out.write(b''.join(reply(i) for i in reversed(ids))); out.flush()\n" \
    "read_frame_blocking(inp)\n"
UNKNOWN_ID = PREAMBLE + "out.write(reply(ids[1]) + reply(max(ids) + 100)); out.flush()\n" \
    "read_frame_blocking(inp)\n"


async def _three_requests(script: str) -> tuple[dict[int, WorkerOutcome], WorkerChannel]:
    """Submit requests 10, 11 and 12; every outcome, once all three have one."""
    channel = await WorkerChannel.spawn((sys.executable, "-c", script))
    await channel.wait_ready(30)
    outcomes: dict[int, WorkerOutcome] = {}
    all_in = asyncio.get_running_loop().create_future()

    def deliver(request_id: int) -> Deliver:
        def on_outcome(outcome: WorkerOutcome) -> None:
            if request_id in outcomes and not all_in.done():
                all_in.set_exception(AssertionError(f"request {request_id} answered twice"))
            outcomes[request_id] = outcome
            if len(outcomes) == 3 and not all_in.done():
                all_in.set_result(None)
        return on_outcome

    for request_id in (10, 11, 12):
        channel.submit(Request(request_id, b"{}"), 30, deliver(request_id))
    await asyncio.wait_for(all_in, 30)
    return outcomes, channel


def test_replies_in_reverse_order_reach_their_own_requests() -> None:
    async def scenario() -> dict[int, WorkerOutcome]:
        outcomes, channel = await _three_requests(REVERSED)
        assert not channel.is_broken
        await channel.stop(grace=5)
        return outcomes

    outcomes = asyncio.run(scenario())
    for request_id, outcome in outcomes.items():
        assert isinstance(outcome, WorkerReply), outcome
        assert outcome.body == b'{"answers": %d}' % request_id


def test_a_reply_with_an_unknown_id_breaks_the_channel() -> None:
    async def scenario() -> tuple[dict[int, WorkerOutcome], WorkerFailure]:
        outcomes, channel = await _three_requests(UNKNOWN_ID)
        failure = await asyncio.wait_for(channel.broken(), 30)
        await channel.kill()
        return outcomes, failure

    outcomes, failure = asyncio.run(scenario())
    assert isinstance(failure, WorkerProtocolError)
    assert "unsolicited" in str(failure) and "112" in str(failure)
    # The reply that did match was delivered; the two still outstanding get the failure, since
    # nothing the worker says afterwards can be trusted.
    answered = outcomes[11]
    assert isinstance(answered, WorkerReply) and answered.body == b'{"answers": 11}'
    assert outcomes[10] is failure and outcomes[12] is failure

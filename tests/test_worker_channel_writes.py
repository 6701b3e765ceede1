"""The front's pipe to the worker: requests let through by replies that arrive together leave in
one write, and every one of them still reaches the worker and is answered."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from clef_dispatch.worker_channel import WorkerChannel
from clef_dispatch.worker_errors import Deliver, WorkerFailure
from clef_protocol.messages import Request, WorkerReply

REPO = Path(__file__).resolve().parent.parent

# Sends `ready`, reads three requests, answers them in ONE write, then answers every later
# request as it comes (one write each).
SCRIPTED_WORKER = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from clef_protocol import messages
from clef_protocol.frames import encode_frame, read_frame_blocking, write_frame_blocking
inp, out = sys.stdin.buffer, sys.stdout.buffer
write_frame_blocking(out, messages.ready(messages.ReadyInfo(
    pid=0, thread="main", model="scripted", variant="v", device="cpu", dtype="float32",
    gdn_path="none")))
first = [read_frame_blocking(inp) for _ in range(3)]
out.write(b"".join(encode_frame(messages.response(m["id"], b"{{}}", 0.0)) for m in first))
out.flush()
while (message := read_frame_blocking(inp)) is not None and message["kind"] == "request":
    write_frame_blocking(out, messages.response(message["id"], b"{{}}", 0.0))
"""


def test_requests_sent_while_replies_are_handed_on_leave_in_one_write() -> None:
    async def scenario() -> tuple[list[int], list[int]]:
        channel = await WorkerChannel.spawn((sys.executable, "-c", SCRIPTED_WORKER))
        await channel.wait_ready(30)
        stdin = channel.process.stdin
        assert stdin is not None
        frames_per_write: list[int] = []
        original = stdin.write

        def counting_write(data: bytes | bytearray | memoryview) -> None:
            frames_per_write.append(bytes(data).count(b"request"))
            original(data)

        stdin.write = counting_write  # type: ignore[method-assign]
        answered: list[int] = []
        done = asyncio.get_running_loop().create_future()

        def deliver(request_id: int) -> Deliver:
            def on_reply(reply: WorkerReply | WorkerFailure) -> None:
                # This runs in the pipe's callback, where a raised assertion would only be
                # logged: a wrong reply fails the wait at once instead of timing it out.
                if not (isinstance(reply, WorkerReply) and reply.status == 200):
                    if not done.done():
                        done.set_exception(AssertionError(
                            f"request {request_id} got {reply!r}"))
                    return
                answered.append(request_id)
                if request_id < 3:  # each of the first three replies lets one more through
                    channel.submit(Request(request_id + 3, b"{}"), 30, deliver(request_id + 3))
                if len(answered) == 6:
                    done.set_result(None)
            return on_reply

        for request_id in range(3):
            channel.submit(Request(request_id, b"{}"), 30, deliver(request_id))
        await asyncio.wait_for(done, 30)
        await channel.stop(grace=5)
        return frames_per_write, answered

    frames_per_write, answered = asyncio.run(scenario())
    assert sorted(answered) == list(range(6))
    # Three writes for the first three (nothing to cork them with), then the three requests
    # let through by the three replies read together (one pipe write of under PIPE_BUF bytes
    # arrives in one read): one write. The last write is `shutdown`.
    assert frames_per_write == [1, 1, 1, 3, 0]

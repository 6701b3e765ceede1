"""One worker process and the framed pipe to it: spawn, wait for `ready`, call, stop.

The channel trusts nothing it reads. End of stream, a truncated, oversize or undecodable frame,
an unexpected kind, a reply nobody asked for or a reply with the wrong id all break the channel
for good: the pending call fails at once with `WorkerFailure` and `broken()` resolves, so the
supervisor can replace the process. A broken channel is never reused, because after one bad
frame nothing later on the pipe can be trusted either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from clef_frontend.worker_errors import WorkerFailure
from clef_protocol import messages
from clef_protocol.frames import MAX_FRAME_BYTES, FrameError, encode_frame, read_frame
from clef_protocol.messages import ReadyInfo

log = logging.getLogger("clef_frontend.worker")


class WorkerExited(WorkerFailure):
    """The worker closed its output: it has exited (or is exiting) on its own."""


class WorkerHung(WorkerFailure):
    """The worker did not answer a request within the request timeout."""


class WorkerProtocolError(WorkerFailure):
    """The worker wrote something that is not a valid frame or reply (it broke the protocol)."""


def failure_reason(failure: WorkerFailure, exit_code: int | None) -> str:
    """Why a warm worker was lost, as one of a few fixed words (a metric label, a log token).

    `cuda_error`: it exited with the status the worker uses after a sticky device error;
    `hung`: it did not answer within the request timeout; `protocol`: it wrote something that is
    not a valid frame, or exited because the front's frame was unreadable; `crash`: anything
    else (it died, was killed, or closed its output).
    """
    if exit_code == messages.EXIT_EXECUTOR_BROKEN:
        return "cuda_error"
    if isinstance(failure, WorkerHung):
        return "hung"
    if isinstance(failure, WorkerProtocolError) or exit_code == messages.EXIT_PROTOCOL_ERROR:
        return "protocol"
    return "crash"


RESTART_REASONS = ("crash", "hung", "protocol", "cuda_error")


# How long a worker that closed its output gets to finish exiting before SIGKILL. Waiting for
# the exit, rather than killing at once, reports its true exit status: asyncio's kill() polls
# the child first and can reap it behind the child watcher's back (the status is then lost).
EXIT_GRACE_SECONDS = 1.0


@dataclass(frozen=True)
class WorkerReply:
    """A `response` (body set) or an `error` (detail set) for the request in flight."""

    status: int
    body: bytes | None
    detail: str | None
    worker_ms: float | None
    input_tokens: int = 0  # the encoded sequence's length (responses only)
    truncated_tokens: int = 0  # state tokens dropped to fit --max-length (responses only)


def _token_count(message: dict[str, Any], key: str) -> int:
    """A response's token count: absent means 0 (an older worker); anything but a
    non-negative integer is a protocol failure."""
    value = message.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WorkerProtocolError(f"malformed response frame ({key} {value!r})")
    return value


def _reply_from(message: dict[str, Any]) -> WorkerReply:
    """Check a reply's fields; anything off is a protocol failure, not a client error.

    A missing status is off too: the worker always sends one, and guessing 200 for it would
    forward whatever body came with a broken frame as a success.
    """
    kind = message["kind"]
    status = message.get("status")
    worker_ms = message.get("worker_ms")
    if not isinstance(worker_ms, int | float) or isinstance(worker_ms, bool):
        worker_ms = None
    if kind == messages.RESPONSE:
        body = message.get("body")
        if not isinstance(body, bytes) or not isinstance(status, int) or not 200 <= status < 300:
            raise WorkerProtocolError(f"malformed response frame (status {status!r})")
        return WorkerReply(status, body, None, worker_ms,
                           input_tokens=_token_count(message, "input_tokens"),
                           truncated_tokens=_token_count(message, "truncated_tokens"))
    detail = message.get("detail")
    if not isinstance(status, int) or not 400 <= status < 600 or not isinstance(detail, str):
        raise WorkerProtocolError(f"malformed error frame (status {status!r})")
    return WorkerReply(status, None, detail, worker_ms)


class WorkerChannel:
    """A started worker process; use `spawn`, then `wait_ready`, then `call` one at a time."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self._broken: asyncio.Future[WorkerFailure] = asyncio.get_running_loop().create_future()
        self._pending: tuple[int, asyncio.Future[WorkerReply]] | None = None
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def spawn(cls, argv: tuple[str, ...]) -> WorkerChannel:
        """Start the worker; stderr is inherited so its log lines reach ours and never fill.

        The worker gets its own session: signals aimed at the front's process group (Ctrl-C,
        timeout(1), job control) reach only the front, which drains and then stops the worker
        with a `shutdown` frame, instead of killing the request in flight.
        """
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,
                start_new_session=True,
            )
        except OSError as exc:
            raise WorkerFailure(f"cannot run worker command {argv[0]!r}: {exc}") from None
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def is_broken(self) -> bool:
        return self._broken.done()

    async def wait_ready(self, timeout: float) -> ReadyInfo:
        """Read the first frame: `ready` starts the reply reader; anything else is a failure."""
        try:
            message = await asyncio.wait_for(self._read(), timeout)
        except TimeoutError:
            raise WorkerFailure(f"worker sent no ready frame within {timeout:g}s") from None
        if message is None:
            code = await self._exit_code(grace=5.0)
            raise WorkerFailure(f"worker exited before it was ready (exit code {code})")
        if message["kind"] == messages.FATAL:
            raise WorkerFailure(f"worker could not start: {message.get('reason', '(no reason)')}")
        if message["kind"] != messages.READY:
            raise WorkerFailure(f"worker sent {message['kind']!r} before ready")
        try:
            info = ReadyInfo.from_message(message)
        except ValueError as exc:
            raise WorkerFailure(str(exc)) from None
        self._reader_task = asyncio.create_task(self._read_replies(), name=f"worker-{self.pid}")
        return info

    async def call(
        self, request_id: int, body: bytes, timeout: float, trace_id: str = ""
    ) -> WorkerReply:
        """Send one request and wait for its reply (one at a time; admission guarantees it).

        A worker that does not answer within `timeout` is taken as hung (a deadlocked kernel, a
        stuck driver call): the channel breaks, so the supervisor kills and replaces it, rather
        than letting one request hold the queue forever.
        """
        if self._broken.done():
            raise self._broken.result()
        if self._pending is not None:
            raise RuntimeError("a request is already in flight on this worker")
        reply: asyncio.Future[WorkerReply] = asyncio.get_running_loop().create_future()
        self._pending = (request_id, reply)
        try:
            if not await self._send(messages.request(request_id, body, trace_id)):
                self._fail(WorkerFailure("worker closed its input"))
            try:
                return await asyncio.wait_for(asyncio.shield(reply), timeout)
            except TimeoutError:
                self._fail(WorkerHung(f"no reply to request {request_id} within {timeout:g}s"))
                return await reply
        finally:
            self._pending = None

    async def broken(self) -> WorkerFailure:
        """Resolve when the channel breaks (the worker died or misbehaved)."""
        return await asyncio.shield(self._broken)

    async def stop(self, grace: float) -> int | None:
        """Ask the worker to finish and exit (`shutdown`, then EOF); kill it after `grace`."""
        if not self._broken.done():
            await self._send(messages.shutdown())
        if self._process.stdin is not None:
            self._process.stdin.close()
        code = await self._exit_code(grace)
        self._fail(WorkerFailure("worker stopped"))
        return code

    async def kill(self) -> int | None:
        """Kill the process (if still running) and reap it, so no zombie is left behind.

        A worker that has already closed its output is given a moment to exit by itself.
        """
        exiting = self._broken.done() and isinstance(self._broken.result(), WorkerExited)
        self._fail(WorkerFailure("worker killed"))
        return await self._exit_code(grace=EXIT_GRACE_SECONDS if exiting else 0.0)

    # -- internals ---------------------------------------------------------------------------

    async def _read(self) -> dict[str, Any] | None:
        assert self._process.stdout is not None
        try:
            return await read_frame(self._process.stdout, MAX_FRAME_BYTES)
        except FrameError as exc:
            raise WorkerProtocolError(f"invalid frame from worker: {exc}") from None

    async def _read_replies(self) -> None:
        """Reader loop: deliver each reply to the pending call; the first anomaly breaks all."""
        try:
            while True:
                message = await self._read()
                if message is None:
                    raise WorkerExited("worker closed its output")
                self._deliver(message)
        except WorkerFailure as failure:
            self._fail(failure)
        except asyncio.CancelledError:
            self._fail(WorkerFailure("worker channel closed"))
            raise

    def _deliver(self, message: dict[str, Any]) -> None:
        kind = message["kind"]
        if kind not in (messages.RESPONSE, messages.ERROR):
            raise WorkerProtocolError(f"unexpected {kind!r} frame from worker")
        if self._pending is None:
            raise WorkerProtocolError(f"unsolicited {kind!r} frame from worker")
        request_id, reply = self._pending
        if message.get("id") != request_id:
            raise WorkerProtocolError(
                f"reply for id {message.get('id')!r} while {request_id} is pending")
        if not reply.done():
            reply.set_result(_reply_from(message))

    async def _send(self, message: dict[str, Any]) -> bool:
        stdin = self._process.stdin
        assert stdin is not None
        try:
            stdin.write(encode_frame(message))
            await stdin.drain()
        except (ConnectionError, RuntimeError):
            return False
        return True

    def _fail(self, failure: WorkerFailure) -> None:
        if not self._broken.done():
            self._broken.set_result(failure)
        if self._pending is not None and not self._pending[1].done():
            self._pending[1].set_exception(failure)
        if self._reader_task is not None and asyncio.current_task() is not self._reader_task:
            self._reader_task.cancel()

    async def _exit_code(self, grace: float) -> int | None:
        """Wait up to `grace` for the exit, then SIGKILL; always reap."""
        if self._process.returncode is None and grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._process.wait(), grace)
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()
        code = await self._process.wait()
        if self._process.stdin is not None:
            self._process.stdin.close()
        return code

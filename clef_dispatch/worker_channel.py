"""The framed pipe to one worker process: wait for `ready`, submit, stop.

Several requests may be outstanding at once (the worker micro-batches what is waiting on its
pipe); each reply is matched to its request by id, and each request has its own deadline. The
deadlines are kept by one watchdog timer aimed at the oldest outstanding request, not one timer
per request: the timeout is the same for all, so the oldest is always the first to expire.

Liveness: once the worker is ready the channel pings it (`ping`/`pong`, every quarter second,
`liveness.ping_interval`) if its ready frame says it answers pings; it answers between forwards.
The rule that judges its silence is `liveness.py`'s: a worker whose pong or reply is overdue by a
short margin is *suspect* (`suspect` says why, and `on_suspect` hears each change: it gets no new
work and admission sends what it holds elsewhere), and healthy again at its next frame. A worker
silent for `--stall-timeout` while a ping or a request waits on it (or sooner, when it owes a pong
with no request ahead of it) is wedged (SIGSTOP, a stuck driver call, a deadlock outside the
request timeout's reach): the channel breaks with `WorkerStalled`, so the supervisor kills and
replaces it and admission sends its requests again. A worker that does not answer pings is
judged by its requests alone: a wedged one is found once a request waits on it, not while idle.

The channel trusts nothing it reads: frames are decoded by `clef_protocol.messages.from_worker`.
End of stream, a truncated, oversize or undecodable frame, an unexpected kind, a malformed field,
or a reply for an id that is not outstanding all break the channel for good: every outstanding
request fails at once with `WorkerFailure` (exactly those, nothing else) and `broken()`
resolves, so the supervisor can replace the process. A broken channel is never reused, because
after one bad frame nothing later on the pipe can be trusted either.

The process itself is worker_process.py's: `spawn` starts it there (its stdout wired to this
channel's callbacks) and builds the channel over it; a worker killed as hung or stalled first
dumps its stack, and every exit is reaped, there too. The failures a channel reports, and the
one word each is counted under, are worker_errors.py's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from clef_dispatch.liveness import (
    ForwardRates,
    Judgement,
    Liveness,
)
from clef_dispatch.liveness_timer import LivenessTimer
from clef_dispatch.worker_errors import (
    Deliver,
    WorkerExited,
    WorkerFailure,
    WorkerHung,
    WorkerProtocolError,
    WorkerStalled,
)
from clef_dispatch.worker_process import dump_stack, exit_code, start_worker
from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.frames import MAX_FRAME_BYTES, FrameBuffer, encode_frame
from clef_protocol.messages import ReadyInfo, Request

log = logging.getLogger("clef_dispatch.worker_channel")


def _ignore_suspicion(_: bool) -> None:
    """Default for `on_suspect`."""


# How long a worker that closed its output gets to finish exiting before SIGKILL. Waiting for
# the exit, rather than killing at once, reports its true exit status: asyncio's kill() polls
# the child first and can reap it behind the child watcher's back (the status is then lost).
EXIT_GRACE_SECONDS = 1.0


@dataclass
class _Outstanding:
    deliver: Deliver
    deadline: float
    timeout: float


class WorkerChannel:
    """The pipe to one started worker; use `spawn`, then `wait_ready`, then `submit`."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._process: asyncio.subprocess.Process | None = None
        self._frames = FrameBuffer(MAX_FRAME_BYTES)
        self._first: asyncio.Future[messages.FromWorker | None] = self._loop.create_future()
        self._started = False  # the ready frame was read: later frames are replies
        self._broken: asyncio.Future[WorkerFailure] = self._loop.create_future()
        self._outstanding: dict[int, _Outstanding] = {}  # insertion order: oldest first
        self._watchdog: asyncio.TimerHandle | None = None
        # While replies are handed on, the requests they let through are framed here and written
        # together afterwards: one pipe write for several frames (see `_on_output`).
        self._corked: list[bytes] | None = None
        # Liveness (see the module docstring; None until `watch_liveness`, and once stopped).
        self._timer: LivenessTimer | None = None
        self._stuck = False  # hung, stalled or silent at start-up: dump its stack before a kill

    @classmethod
    async def spawn(
        cls, argv: tuple[str, ...], env: Mapping[str, str] | None = None
    ) -> WorkerChannel:
        """Start the worker (worker_process.start_worker: its own session, stderr inherited,
        `env` added to the front's) and the channel over it; its stdout feeds this channel
        from the start."""
        channel = cls()
        channel._process = await start_worker(argv, env, on_output=channel._on_output,
                                              on_output_end=channel._on_output_end)
        return channel

    @property
    def process(self) -> asyncio.subprocess.Process:
        assert self._process is not None
        return self._process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def is_broken(self) -> bool:
        return self._broken.done()

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._outstanding)

    async def wait_ready(self, timeout: float) -> ReadyInfo:
        """Wait for the first frame: after `ready` the rest are replies; else a failure."""
        try:
            frame = await asyncio.wait_for(self._first, timeout)
        except TimeoutError:
            self._stuck = True
            raise WorkerFailure(f"worker sent no ready frame within {timeout:g}s") from None
        if frame is None:
            code = await self._exit_code(grace=5.0)
            raise WorkerFailure(f"worker exited before it was ready (exit code {code})")
        if isinstance(frame, messages.Fatal):
            raise WorkerFailure(f"worker could not start: {frame.reason}")
        if not isinstance(frame, ReadyInfo):
            raise WorkerFailure(f"worker sent {type(frame).__name__} before ready")
        info = frame
        self._started = True
        return info

    def watch_liveness(self, stall_timeout: float, *, pings: bool,
                       rates: ForwardRates | None = None,
                       on_suspect: Callable[[bool], None] | None = None) -> None:
        """Judge the (ready) worker's silence (liveness.py): suspect after a short margin, wedged
        after `stall_timeout`; ping it meanwhile if it answers pings (its ready frame says so).

        `rates` are its slot's recent forwards (the estimate of the work it holds); `on_suspect`
        hears each change of suspicion (True: suspect, False: healthy again).
        """
        if self._timer is not None or self._broken.done():
            return
        self._timer = LivenessTimer(
            self._loop, Liveness(stall_timeout=stall_timeout, rates=rates or ForwardRates(),
                                 clock=self._loop.time),
            pings=pings, write=self._write, fail=self._wedged, in_flight=lambda: self.in_flight,
            on_suspect=on_suspect or _ignore_suspicion)

    @property
    def suspect(self) -> Judgement | None:
        """Why the worker is suspect (None: it is not): what it owes and for how long."""
        return self._timer.suspect if self._timer is not None else None

    @property
    def suspect_for(self) -> float:
        """Seconds since the worker became suspect (0 when it is not)."""
        return self._timer.suspect_for if self._timer is not None else 0.0

    def submit(self, request: Request, timeout: float, deliver: Deliver) -> None:
        """Send one request; `deliver` is called once with its reply or its failure.

        No task and no await per request: the frame is written at once (the pipe's transport
        buffers it) and the reply is handed to `deliver` as soon as it is decoded (in the
        pipe's callback). A worker that does not answer within `timeout` is taken as hung (a
        deadlocked kernel, a stuck driver call): the channel breaks, so the supervisor kills and
        replaces it, rather than letting it hold requests forever.
        """
        if self._broken.done():
            deliver(self._broken.result())
            return
        if request.id in self._outstanding:
            raise RuntimeError(f"frame id {request.id} is already in flight on this worker")
        if self._timer is not None and not self._timer.request_sent(request.id,
                                                                     len(request.body)):
            deliver(self._broken.result())
            return
        self._outstanding[request.id] = _Outstanding(deliver, self._loop.time() + timeout,
                                                     timeout)
        if self._watchdog is None:
            self._arm_watchdog()
        if not self._write(request.message()):
            self._fail(WorkerExited("worker closed its input"))

    async def broken(self) -> WorkerFailure:
        """Resolve when the channel breaks (the worker died or misbehaved)."""
        return await asyncio.shield(self._broken)

    async def stop(self, grace: float) -> int | None:
        """Ask the worker to finish and exit (`shutdown`, then EOF); kill it after `grace`."""
        self._stop_liveness()  # a retiring worker finishes what it holds, however long
        if not self._broken.done():
            self._write(messages.shutdown())
        if self.process.stdin is not None:
            self.process.stdin.close()
        code = await self._exit_code(grace)
        self._fail(WorkerFailure("worker stopped"))
        return code

    async def kill(self) -> int | None:
        """Kill the process (if still running) and reap it, so no zombie is left behind.

        A worker that has already closed its output is given a moment to exit by itself; one
        that is stuck (hung, stalled, silent at start-up) first dumps its stack to the log.
        """
        exiting = self._broken.done() and isinstance(self._broken.result(), WorkerExited)
        self._fail(WorkerFailure("worker killed"))
        if self._stuck and not exiting:
            await self._dump_stack()
        return await self._exit_code(grace=EXIT_GRACE_SECONDS if exiting else 0.0)

    async def _dump_stack(self) -> None:
        await dump_stack(self.process)

    # -- internals ---------------------------------------------------------------------------

    def _on_output(self, data: bytes) -> None:
        """Bytes from the worker's stdout: decode every whole frame and hand it on."""
        if self._broken.done():
            return  # nothing after the first anomaly can be trusted
        self._frames.feed(data)
        # Each reply frees a slot that admission fills at once, on this worker among others:
        # the frames sent from here leave in one write once every reply in `data` is handed on.
        self._corked = []
        try:
            while (message := self._frames.next_frame()) is not None:
                frame = messages.from_worker(message)
                if not self._first.done():
                    self._first.set_result(frame)
                elif not self._started:
                    raise WorkerProtocolError(
                        f"worker sent {message['kind']!r} right after its first frame")
                else:
                    self._deliver(frame)
        except ProtocolError as exc:
            self._lose(WorkerProtocolError(f"invalid frame from worker: {exc}"))
        except WorkerFailure as failure:
            self._lose(failure)
        finally:
            corked, self._corked = self._corked, None
            if corked and not self._send_bytes(b"".join(corked)):
                self._fail(WorkerExited("worker closed its input"))

    def _on_output_end(self) -> None:
        """The worker closed its stdout (it exited, or is exiting)."""
        if self._broken.done():
            return
        try:
            self._frames.end()
        except ProtocolError as exc:
            self._lose(WorkerProtocolError(f"invalid frame from worker: {exc}"))
            return
        self._lose(WorkerExited("worker closed its output"))

    def _lose(self, failure: WorkerFailure) -> None:
        """The output is unusable: tell `wait_ready` if it still waits, and break."""
        if not self._first.done():
            if isinstance(failure, WorkerExited):
                self._first.set_result(None)
            else:
                self._first.set_exception(failure)
        self._fail(failure)

    def _deliver(self, frame: messages.FromWorker) -> None:
        if isinstance(frame, messages.Pong):
            if self._timer is None or not self._timer.pong(frame.seq):
                raise WorkerProtocolError(f"unsolicited pong from worker (seq {frame.seq!r})")
            log.debug("worker pid=%d: pong %d", self.pid, frame.seq)
            return
        if not isinstance(frame, messages.WorkerReply):
            raise WorkerProtocolError(f"unexpected {type(frame).__name__} frame from worker")
        waiting = self._outstanding.pop(frame.id, None)
        if waiting is None:
            kind = messages.RESPONSE if frame.body is not None else messages.ERROR
            raise WorkerProtocolError(f"unsolicited {kind!r} frame from worker (id {frame.id!r})")
        if self._timer is not None:
            self._timer.answered(frame)
        waiting.deliver(frame)

    def _write(self, message: dict[str, Any]) -> bool:
        """Queue a frame on the worker's stdin; False if the pipe is already gone.

        Not awaited: at most `--max-batch` requests per worker are outstanding, so what the
        transport buffers is bounded by that many bodies; a worker that stops reading is
        caught by the request deadline.
        """
        frame = encode_frame(message)
        if self._corked is not None:
            self._corked.append(frame)
            return not self._stdin_closing()
        return self._send_bytes(frame)

    def _stdin_closing(self) -> bool:
        stdin = self.process.stdin
        return stdin is None or stdin.is_closing()

    def _send_bytes(self, data: bytes) -> bool:
        stdin = self.process.stdin
        if stdin is None or self._stdin_closing():
            return False
        try:
            stdin.write(data)
        except (ConnectionError, RuntimeError):
            return False
        return True

    def _arm_watchdog(self) -> None:
        """Aim the one timer at the oldest outstanding request's deadline."""
        self._watchdog = None
        for request_id, waiting in self._outstanding.items():
            if waiting.deadline <= self._loop.time():
                self._stuck = True
                self._fail(WorkerHung(f"no reply to request {request_id} within "
                                      f"{waiting.timeout:g}s"))
                return
            self._watchdog = self._loop.call_at(waiting.deadline, self._arm_watchdog)
            return

    def _wedged(self, failure: WorkerFailure) -> None:
        """The liveness timer found the worker wedged (or its pipe gone): break, and dump its
        stack before the kill when it was wedged."""
        if isinstance(failure, WorkerStalled):
            self._stuck = True
        self._fail(failure)

    def _stop_liveness(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.stop()

    def _fail(self, failure: WorkerFailure) -> None:
        """Break the channel for good; every outstanding request gets `failure`, once."""
        if not self._broken.done():
            self._broken.set_result(failure)
        self._stop_liveness()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        lost, self._outstanding = self._outstanding, {}
        for waiting in lost.values():
            waiting.deliver(failure)

    async def _exit_code(self, grace: float) -> int | None:
        return await exit_code(self.process, grace)

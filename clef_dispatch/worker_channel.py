"""One worker process and the framed pipe to it: spawn, wait for `ready`, submit, stop.

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

A worker killed as hung or stalled is first sent `STACK_DUMP_SIGNAL` (and SIGCONT, should it be
stopped): it writes every thread's stack to the log and exits, so the log says where it was
stuck; one still there `STACK_DUMP_SECONDS` later is SIGKILLed (gunicorn's SIGABRT-then-SIGKILL,
without the core file).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from clef_dispatch.liveness import (
    ForwardRates,
    Judgement,
    Liveness,
    Verdict,
    ping_interval,
)
from clef_dispatch.worker_errors import Deliver, WorkerFailure, WorkerLost
from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.frames import MAX_FRAME_BYTES, FrameBuffer, encode_frame
from clef_protocol.messages import ReadyInfo, Request

log = logging.getLogger("clef_dispatch.worker_channel")


class WorkerExited(WorkerLost):
    """The worker closed its output: it has exited (or is exiting) on its own."""


class WorkerHung(WorkerLost):
    """The worker did not answer a request within the request timeout."""

    reason = "hung"


class WorkerProtocolError(WorkerLost):
    """The worker wrote something that is not a valid frame or reply (it broke the protocol)."""

    reason = "protocol"


class WorkerStalled(WorkerLost):
    """The worker answered neither a ping nor a request for the stall timeout (wedged)."""

    reason = "stalled"


def _ignore_suspicion(_: bool) -> None:
    """Default for `on_suspect`."""


def failure_reason(failure: WorkerFailure, exit_code: int | None) -> str:
    """Why a warm worker was lost, as one of a few fixed words (a metric label, a log token).

    `cuda_error`: it exited with the status the worker uses after a sticky device error;
    `hung`: it did not answer within the request timeout; `stalled`: it answered neither
    pings nor requests for the stall timeout; `protocol`: it wrote something that is
    not a valid frame, or exited because the front's frame was unreadable; `crash`: anything
    else (it died, was killed, or closed its output).
    """
    if exit_code == messages.EXIT_EXECUTOR_BROKEN:
        return "cuda_error"
    if isinstance(failure, WorkerHung | WorkerStalled):
        return failure.reason
    if isinstance(failure, WorkerProtocolError) or exit_code == messages.EXIT_PROTOCOL_ERROR:
        return "protocol"
    return "crash"


RESTART_REASONS = ("crash", "hung", "protocol", "cuda_error", "stalled")


# How long a worker that closed its output gets to finish exiting before SIGKILL. Waiting for
# the exit, rather than killing at once, reports its true exit status: asyncio's kill() polls
# the child first and can reap it behind the child watcher's back (the status is then lost).
EXIT_GRACE_SECONDS = 1.0


@dataclass
class _Outstanding:
    deliver: Deliver
    deadline: float
    timeout: float


class _Pipes(asyncio.subprocess.SubprocessStreamProtocol):
    """The worker's pipes: stdin stays a StreamWriter; stdout goes straight to the channel.

    Decoding replies in the pipe's own callback, instead of in a task reading a StreamReader,
    saves an event-loop turn per reply: the reply reaches its request the moment it arrives.
    """

    def __init__(self, channel: WorkerChannel, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=2**16, loop=loop)
        self._channel = channel

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd == 1:
            assert isinstance(data, bytes)
            self._channel._on_output(data)
        else:
            super().pipe_data_received(fd, data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        super().pipe_connection_lost(fd, exc)
        if fd == 1:
            self._channel._on_output_end()


class WorkerChannel:
    """A started worker process; use `spawn`, then `wait_ready`, then `submit`."""

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
        # Liveness (see the module docstring): the judge of its silence (None until
        # `watch_liveness`), the ping awaiting its pong (None: none), the one timer that sends
        # pings and judges, and the current suspicion (None: healthy).
        self._liveness: Liveness | None = None
        self._ping_seq = 0
        self._ping_waiting: int | None = None
        self._pinger: asyncio.TimerHandle | None = None
        self._pings = False  # whether the worker answers pings (its ready frame's `pings`)
        self._suspect: Judgement | None = None
        self._suspect_since = 0.0
        self._on_suspect: Callable[[bool], None] = _ignore_suspicion
        self._stuck = False  # hung, stalled or silent at start-up: dump its stack before a kill

    @classmethod
    async def spawn(
        cls, argv: tuple[str, ...], env: Mapping[str, str] | None = None
    ) -> WorkerChannel:
        """Start the worker; stderr is inherited so its log lines reach ours and never fill.

        `env` adds to (or overrides in) the front's environment, e.g. the worker's
        `CUDA_VISIBLE_DEVICES`.

        The worker gets its own session: signals aimed at the front's process group (Ctrl-C,
        timeout(1), job control) reach only the front, which drains and then stops the worker
        with a `shutdown` frame, instead of killing the request in flight.
        """
        channel = cls()
        loop = channel._loop
        try:
            transport, protocol = await loop.subprocess_exec(
                lambda: _Pipes(channel, loop),
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=None,
                start_new_session=True,
                env=None if not env else {**os.environ, **env},
            )
        except OSError as exc:
            raise WorkerFailure(f"cannot run worker command {argv[0]!r}: {exc}") from None
        channel._process = asyncio.subprocess.Process(transport, protocol, loop)
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
        self._liveness = Liveness(stall_timeout=stall_timeout, rates=rates or ForwardRates(),
                                  clock=self._loop.time)
        self._pings = pings
        if on_suspect is not None:
            self._on_suspect = on_suspect
        if self._pinger is None and not self._broken.done():
            self._pinger = self._loop.call_at(self._loop.time(), self._tick)

    @property
    def suspect(self) -> Judgement | None:
        """Why the worker is suspect (None: it is not): what it owes and for how long."""
        return self._suspect

    @property
    def suspect_for(self) -> float:
        """Seconds since the worker became suspect (0 when it is not)."""
        return self._loop.time() - self._suspect_since if self._suspect is not None else 0.0

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
        if self._liveness is not None:
            # A fresh ping ahead of the request (unless one is owed): an idle worker owes its
            # pong at once, so one that wedged since its last pong is suspect within the floor,
            # whatever the request's length.
            if self._pings and self._ping_waiting is None and not self._send_ping():
                deliver(self._broken.result())
                return
            self._liveness.request_sent(request.id, len(request.body))
        self._outstanding[request.id] = _Outstanding(deliver, self._loop.time() + timeout,
                                                     timeout)
        if self._watchdog is None:
            self._arm_watchdog()
        self._look_sooner()
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
        """Ask the stuck worker for its stack (`STACK_DUMP_SIGNAL`; SIGCONT wakes a stopped
        one), which it writes before it exits; wait for the exit up to `STACK_DUMP_SECONDS`."""
        process = self.process
        if process.returncode is not None:
            return
        log.warning("worker pid=%d is stuck: asking for its stack (signal %s) before the kill",
                    self.pid, messages.STACK_DUMP_SIGNAL.name)
        for handler in log.handlers or logging.getLogger("clef_dispatch").handlers:
            handler.flush()  # this line before the stack, not in the middle of one of its lines
        try:
            process.send_signal(messages.STACK_DUMP_SIGNAL)
            process.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), messages.STACK_DUMP_SECONDS)

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
            if self._ping_waiting is None or frame.seq != self._ping_waiting:
                raise WorkerProtocolError(f"unsolicited pong from worker (seq {frame.seq!r})")
            self._ping_waiting = None
            if self._liveness is not None:
                self._liveness.pong()
            log.debug("worker pid=%d: pong %d", self.pid, frame.seq)
            self._sign_of_life()
            return
        if not isinstance(frame, messages.WorkerReply):
            raise WorkerProtocolError(f"unexpected {type(frame).__name__} frame from worker")
        waiting = self._outstanding.pop(frame.id, None)
        if waiting is None:
            kind = messages.RESPONSE if frame.body is not None else messages.ERROR
            raise WorkerProtocolError(f"unsolicited {kind!r} frame from worker (id {frame.id!r})")
        if self._liveness is not None:
            self._liveness.request_answered(frame.id, frame.input_tokens, frame.worker_ms,
                                            cut=frame.truncated_tokens > 0)
        self._sign_of_life()
        waiting.deliver(frame)

    def _sign_of_life(self) -> None:
        """A sign of life: a suspect is judged again now (healthy again unless it still owes
        something overdue), and the timer may have to look sooner."""
        if self._suspect is not None and self._liveness is not None:
            self._judge(self._liveness.judge())
        self._look_sooner()

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

    def _tick(self) -> None:
        """The liveness timer: judge the silence, then ping if one is due; look again when the
        verdict would change or the next ping is due, whichever is sooner."""
        self._pinger = None
        liveness = self._liveness
        if self._broken.done() or liveness is None:
            return
        if not self._judge(liveness.judge()):
            return
        if self._pings and liveness.ping_due() and not self._send_ping():
            return
        self._pinger = self._loop.call_at(self._next_look(liveness), self._tick)

    def _next_look(self, liveness: Liveness) -> float:
        """When the verdict would change or the next ping is due, whichever is sooner."""
        looks = [liveness.judge().next_look, liveness.next_ping_at() if self._pings else None]
        return min((look for look in looks if look is not None),
                   default=self._loop.time() + liveness.stall_timeout / 3)

    def _look_sooner(self) -> None:
        """After a pong, a reply or a request the verdict may change sooner than the timer is
        aimed (the next ping is due, the margin shrank or became known): the timer looks again
        within a ping interval. Not judged here: a judgement costs a hundred microseconds with
        a full batch held, too much for every reply."""
        liveness = self._liveness
        if liveness is None or self._pinger is None:
            return
        soon = self._loop.time() + ping_interval(liveness.stall_timeout)
        if soon < self._pinger.when():
            self._pinger.cancel()
            self._pinger = self._loop.call_at(soon, self._tick)

    def _send_ping(self) -> bool:
        """Write a ping (none may be owed); False if the pipe is gone (the channel is broken)."""
        assert self._liveness is not None
        self._ping_seq += 1
        self._ping_waiting = self._ping_seq
        self._liveness.ping_sent()
        if not self._write(messages.ping(self._ping_seq)):
            self._fail(WorkerExited("worker closed its input"))
            return False
        return True

    def _judge(self, judgement: Judgement) -> bool:
        """Act on a verdict: break the channel if wedged (False), else track the suspicion and
        tell `on_suspect` of each change (True)."""
        liveness = self._liveness
        assert liveness is not None
        if judgement.verdict is Verdict.WEDGED:
            self._stuck = True
            if judgement.kill_after >= liveness.stall_timeout:
                self._fail(WorkerStalled(
                    f"no pong and no reply within {liveness.stall_timeout:g}s "
                    f"({len(self._outstanding)} request(s) in flight)"))
            else:
                self._fail(WorkerStalled(
                    f"no pong within {judgement.kill_after:g}s with no request ahead of it "
                    f"({len(self._outstanding)} request(s) in flight)"))
            return False
        was_suspect = self._suspect is not None
        if judgement.verdict is Verdict.SUSPECT:
            if not was_suspect:
                self._suspect_since = self._loop.time()
            self._suspect = judgement
            if not was_suspect:
                self._on_suspect(True)
        elif was_suspect:
            self._suspect = None
            self._on_suspect(False)
        return True

    def _stop_liveness(self) -> None:
        self._liveness = None
        self._suspect = None
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None

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
        """Wait up to `grace` for the exit, then SIGKILL; always reap."""
        if self.process.returncode is None and grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), grace)
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        code = await self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()
        return code

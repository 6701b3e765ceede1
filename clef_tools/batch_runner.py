"""Drive one worker through a list of jobs: the pipe kept full, answers written as they come.

The worker is the server's own (`WorkerChannel.spawn` + `wait_ready`, as the supervisor starts
it), and it is fed the way the front feeds it: up to `max_batch` requests outstanding, each
reply letting the next request through from inside the reply's callback, so the worker always
finds a full batch waiting on its pipe. Jobs arrive sorted by body length, so the requests
batched together have similar lengths and little padding.

A worker that dies or hangs takes its outstanding requests with it. Those are not answered
500 at once: one request that crashes the worker would otherwise fail every request batched with
it. They are rerun one at a time on a fresh worker; the one that fails again alone is the cause
and gets the API's 500 `inference failed`. After `max_restarts` replacements the run gives up
(exit status 3), and a rerun resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from clef_frontend import responses
from clef_frontend.supervisor import default_max_batch
from clef_frontend.worker_channel import WorkerChannel, WorkerReply
from clef_frontend.worker_errors import WorkerFailure
from clef_protocol.messages import ReadyInfo
from clef_tools.batch_input import Job
from clef_tools.batch_output import answered_line, new_request_id
from clef_tools.screening import finish

# Exit statuses (docs/batch.md).
EXIT_DONE = 0
EXIT_BAD_LINES = 1
EXIT_NOT_STARTED = 2
EXIT_GAVE_UP = 3
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class WorkerSettings:
    """How the worker is started and fed (the front's flags of the same names)."""

    argv: tuple[str, ...]
    max_batch: int | None = None  # None: the front's default for the worker's device
    startup_timeout: float = 900.0
    request_timeout: float = 300.0
    shutdown_grace: float = 10.0
    max_restarts: int = 5


@dataclass
class RunState:
    """Counts for the summary line and the exit status."""

    statuses: Counter[int] = field(default_factory=Counter)
    # Requests answered by the worker, and the sum of the sizes of the forwards that answered
    # them: their ratio is the mean batch a request was part of (did batching happen?).
    worker_answers: int = 0
    batch_size_sum: int = 0
    restarts: int = 0
    interrupted: bool = False
    gave_up: str | None = None
    ready: ReadyInfo | None = None


class BatchRunner:
    """Answers `jobs` with one worker (replaced when it fails); `write` gets each output line."""

    def __init__(self, jobs: list[Job], settings: WorkerSettings,
                 write: Callable[[bytes], None], on_answer: Callable[[], None],
                 say: Callable[[str], None]) -> None:
        self._pending: deque[Job] = deque(jobs)
        self._suspects: deque[Job] = deque()  # lost with a failed worker: rerun alone
        self._settings = settings
        self._write = write
        self._on_answer = on_answer
        self._say = say
        self._ids = itertools.count(1)
        self._lost_once: set[str] = set()
        self._channel: WorkerChannel | None = None
        self._max_batch = 1
        self._idle = asyncio.Event()
        self._stop = asyncio.Event()
        self._force = False
        self.state = RunState()

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunState:
        """Answer every job, or stop early (SIGINT/SIGTERM, too many worker failures)."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._interrupt)
        try:
            while self._has_work() and not self._stop.is_set():
                channel = await self._start_worker()
                if channel is None:
                    break
                self._channel = channel
                self._idle.clear()
                self._pump()
                broken = asyncio.ensure_future(channel.broken())
                idle = asyncio.ensure_future(self._idle.wait())
                await asyncio.wait({broken, idle}, return_when=asyncio.FIRST_COMPLETED)
                idle.cancel()
                broken.cancel()
                if channel.is_broken and not self._stop.is_set() and self._has_work():
                    await self._replace(channel)
                    continue
                break
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            if not self._has_work():
                # Said before the worker's exit, which can take seconds: a rate measured up to
                # this line is the answering's alone (bench/bench_batch_vs_server.py).
                mean = self.state.batch_size_sum / max(self.state.worker_answers, 1)
                self._say(f"clef-batch: every request answered "
                          f"({sum(self.state.statuses.values())} this run, forwards of "
                          f"{mean:.1f} requests on average); stopping the worker")
            if self._channel is not None:
                channel, self._channel = self._channel, None
                if self._force:
                    await channel.kill()
                else:
                    await channel.stop(self._settings.shutdown_grace)
        return self.state

    def _has_work(self) -> bool:
        return bool(self._pending or self._suspects)

    async def _start_worker(self) -> WorkerChannel | None:
        """A warm worker, or None when the run stopped (or gave up) before one was ready."""
        settings = self._settings
        while True:
            channel = await WorkerChannel.spawn(settings.argv)
            ready = asyncio.ensure_future(channel.wait_ready(settings.startup_timeout))
            stopped = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not ready.done():
                ready.cancel()
                with contextlib.suppress(asyncio.CancelledError, WorkerFailure):
                    await ready
                await channel.kill()
                return None
            try:
                info = ready.result()
            except WorkerFailure as exc:
                await channel.kill()
                if self.state.ready is None:
                    raise  # the first start: the operator must see why, nothing ran
                self.state.restarts += 1
                if self.state.restarts > settings.max_restarts:
                    self.state.gave_up = f"replacement worker failed to start: {exc}"
                    return None
                self._say(f"clef-batch: replacement worker failed to start ({exc}); retrying")
                continue
            if self.state.ready is None:
                self._say(f"clef-batch: worker ready (pid {info.pid}, device {info.device}, "
                          f"dtype {info.dtype}, warm-up {info.warmup_ms:.0f} ms)")
                if info.demo:
                    self._say("clef-batch: DEMO SNAPSHOT: a tiny random model; its answers are "
                              "meaningless")
            self.state.ready = info
            self._max_batch = settings.max_batch or default_max_batch(info.device,
                                                                        info.max_sequences)
            return channel

    async def _replace(self, channel: WorkerChannel) -> None:
        """The worker failed: reap it and count the restart (the next loop starts another)."""
        failure = await channel.broken()
        code = await channel.kill()
        self._channel = None
        self.state.restarts += 1
        self._say(f"clef-batch: worker failed ({failure}, exit code {code}); "
                  f"{len(self._suspects)} request(s) it held will be rerun one at a time")
        if self.state.restarts > self._settings.max_restarts:
            self.state.gave_up = (f"the worker failed {self.state.restarts} times "
                                  f"(--max-restarts {self._settings.max_restarts})")
            self._stop.set()

    def _interrupt(self) -> None:
        """First signal: send nothing more, finish what the worker holds. Second: stop now."""
        if self._stop.is_set():
            self._force = True
            self._idle.set()
            return
        self.state.interrupted = True
        self._say("clef-batch: interrupted; finishing the requests in flight (again to stop "
                  "at once); rerun the same command to resume")
        self._stop.set()
        if self._channel is None or self._channel.in_flight == 0:
            self._idle.set()

    # -- feeding the worker ------------------------------------------------------------------

    def _pump(self) -> None:
        """Send jobs while the worker has room: suspects alone, the rest up to max_batch."""
        channel = self._channel
        if channel is None or channel.is_broken or self._stop.is_set():
            return
        while self._suspects or self._pending:
            if self._suspects:
                if channel.in_flight:
                    return
                self._send(channel, self._suspects.popleft())
                return
            if channel.in_flight >= self._max_batch:
                return
            self._send(channel, self._pending.popleft())

    def _send(self, channel: WorkerChannel, job: Job) -> None:
        request_id = new_request_id()

        def deliver(outcome: WorkerReply | WorkerFailure) -> None:
            self._answered(channel, job, request_id, outcome)

        channel.submit(next(self._ids), job.body, self._settings.request_timeout, deliver,
                       request_id)

    def _answered(self, channel: WorkerChannel, job: Job, request_id: str,
                  outcome: WorkerReply | WorkerFailure) -> None:
        if isinstance(outcome, WorkerFailure):
            if job.custom_id not in self._lost_once:
                self._lost_once.add(job.custom_id)
                self._suspects.append(job)
                return
            self._say(f"clef-batch: {job.custom_id!r} (line {job.line}) failed the worker "
                      f"again when run alone: answered 500 ({outcome})")
            reply = responses.error(500, responses.INFERENCE_FAILED)
        else:
            reply = responses.from_worker(outcome)
            self.state.worker_answers += 1
            self.state.batch_size_sum += outcome.batch_size
        self.record(job, request_id, reply)
        if not channel.is_broken:
            self._pump()
        if channel.in_flight == 0 and (self._stop.is_set() or not self._has_work()):
            self._idle.set()

    def record(self, job: Job, request_id: str, reply: responses.Reply) -> None:
        """Write one job's answer (as its route shapes it) and count it."""
        reply = finish(job, reply)
        self._write(answered_line(job.custom_id, request_id, reply))
        self.state.statuses[reply.status] += 1
        self._on_answer()

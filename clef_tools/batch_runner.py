"""Drive the server's dispatch through a list of jobs: the workers kept fed, answers written as
they come.

The workers, their supervision and the queue are the server's own (`clef_dispatch`):
the same start, liveness (`--stall-timeout`, `--request-timeout`, the stack of a stuck worker
in the log), restart with back-off, and resend-alone policy. A request lost with a worker is not
answered 500 at once, since one request that crashes the worker would otherwise fail every
request batched with it: it is sent again alone, and the one that fails again alone is the
cause and gets the API's 500 `inference failed`. What differs from the server is the give-up:
after `--max-restarts` replacements the run stops (exit status 3), and a rerun resumes.

Jobs arrive sorted by body length and are submitted in that order, a bounded window ahead of
the workers (`FEED_AHEAD`), so requests batched together have similar lengths and little
padding, and a million-line input never becomes a million queued tickets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from clef_api import responses
from clef_dispatch import (
    Dispatcher,
    DispatchEvents,
    Outcome,
    Refusal,
    TicketView,
    WorkerSettings,
)
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

# Tickets queued ahead of the workers: far more than any worker holds (--max-batch), so a
# worker never waits for the next request, and few enough to keep memory flat.
FEED_AHEAD = 1024


@dataclass
class RunState:
    """Counts for the summary line and the exit status."""

    statuses: Counter[int] = field(default_factory=Counter)
    # Requests answered by a worker, and the sum of the sizes of the forwards that answered
    # them: their ratio is the mean batch a request was part of (did batching happen?).
    worker_answers: int = 0
    batch_size_sum: int = 0
    restarts: int = 0
    interrupted: bool = False
    gave_up: str | None = None
    ready: ReadyInfo | None = None
    # Why nothing was run on a resumed output: it was written under other weights.
    other_weights: str | None = None


class BatchRunner:
    """Answers `jobs` through a `Dispatcher`; `write` gets each output line."""

    def __init__(self, jobs: list[Job], settings: WorkerSettings,
                 write: Callable[[bytes], None], on_answer: Callable[[], None],
                 say: Callable[[str], None], *,
                 check_weights: Callable[[set[str]], str | None] | None = None,
                 before: Callable[[], None] | None = None) -> None:
        """`check_weights` gets the fingerprints the ready workers serve and says why the run
        must not append (clef_tools.resume.other_weights), before anything is written;
        `before` writes what needs no worker, once it may."""
        self._check_weights = check_weights
        self._before = before
        self._pending: deque[Job] = deque(jobs)
        self._settings = settings
        self._write = write
        self._on_answer = on_answer
        self._say = say
        self._open: dict[TicketView, Job] = {}  # submitted, not yet answered
        self._dispatch: Dispatcher | None = None
        self._stop = asyncio.Event()  # send nothing more (a signal, or the pool gave up)
        self._finished = asyncio.Event()  # nothing more will be answered this run
        self._force = False
        self._announced: set[int] = set()  # worker pids said ready
        self.state = RunState()

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> RunState:
        """Answer every job, or stop early (SIGINT/SIGTERM, a worker slot gave up).

        Raises StartupFailed when the workers cannot start (nothing ran).
        """
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._interrupt)
        dispatch = self._dispatch = Dispatcher(
            self._settings, queue_size=FEED_AHEAD, wait_for_workers=True,
            events=DispatchEvents(ready=self._worker_ready, gave_up=self._gave_up))
        supervise: asyncio.Task[None] | None = None
        try:
            if await self._started(dispatch) and self._may_append(dispatch):
                supervise = asyncio.create_task(dispatch.supervise(), name="supervisor")
                self._feed()
                await self._finished.wait()
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
            if supervise is not None:
                supervise.cancel()
                await asyncio.wait({supervise})
            self.state.restarts = dispatch.restarts
            if not self._has_work() and self.state.other_weights is None:
                # Said before the workers' exit, which can take seconds: a rate measured up to
                # this line is the answering's alone (bench/bench_batch_vs_server.py).
                mean = self.state.batch_size_sum / max(self.state.worker_answers, 1)
                self._say(f"clef-batch: every request answered "
                          f"({sum(self.state.statuses.values())} this run, forwards of "
                          f"{mean:.1f} requests on average); stopping the worker")
            await dispatch.stop(grace=0.0 if self._force else None)
        return self.state

    async def _started(self, dispatch: Dispatcher) -> bool:
        """Start the workers; False when a signal came first (they are stopped again)."""
        starting = asyncio.ensure_future(dispatch.start())
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if starting.done():
            starting.result()  # StartupFailed: the operator must see why
            return True
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return False

    def _may_append(self, dispatch: Dispatcher) -> bool:
        """Whether the output may take this run's lines: the weights its lines name are
        served now (or the check is off); then what needs no worker is written first."""
        if self._check_weights is not None:
            served: set[str] = set()
            for info in dispatch.ready_infos():
                served.update((info.weights.base, *info.weights.variants.values()))
            self.state.other_weights = self._check_weights(served - {""})
            if self.state.other_weights is not None:
                self._pending.clear()
                return False
        if self._before is not None:
            self._before()
        return True

    def _has_work(self) -> bool:
        return bool(self._pending or self._open)

    def _worker_ready(self) -> None:
        """A worker became ready (first start or replacement): say so, once per process."""
        assert self._dispatch is not None
        for info in self._dispatch.ready_infos():
            if info.pid in self._announced:
                continue
            self._announced.add(info.pid)
            if self.state.ready is None and info.demo:
                self._say("clef-batch: DEMO SNAPSHOT: a tiny random model; its answers are "
                          "meaningless")
            self.state.ready = info
            self._say(f"clef-batch: worker ready (pid {info.pid}, device {info.device}, "
                      f"dtype {info.dtype}, warm-up {info.warmup_ms:.0f} ms)")

    def _gave_up(self, reason: str) -> None:
        """A worker slot spent its `--max-restarts`: stop; a rerun resumes what is left."""
        self.state.gave_up = reason
        self._stop_sending()
        self._finished.set()

    def _interrupt(self) -> None:
        """First signal: send nothing more, finish what the workers hold. Second: stop now."""
        if self._stop.is_set():
            self._force = True
            self._finished.set()
            return
        self.state.interrupted = True
        self._say("clef-batch: interrupted; finishing the requests in flight (again to stop "
                  "at once); rerun the same command to resume")
        self._stop_sending()
        self._check_finished()

    def _stop_sending(self) -> None:
        """Nothing more is submitted, and what waits is withdrawn (a rerun answers it)."""
        self._stop.set()
        assert self._dispatch is not None
        for ticket in [t for t in self._open if t.waiting]:
            del self._open[ticket]
            self._dispatch.abandon(ticket)

    # -- feeding the workers -----------------------------------------------------------------

    def _feed(self) -> None:
        """Submit jobs in order while fewer than FEED_AHEAD wait."""
        dispatch = self._dispatch
        assert dispatch is not None
        while self._pending and not self._stop.is_set() and \
                dispatch.depth < FEED_AHEAD:
            job = self._pending.popleft()
            request_id = new_request_id()
            ticket = dispatch.submit(job.body, request_id)
            if isinstance(ticket, Refusal):  # only while stopping: the queue is never full
                self.record(job, request_id, responses.from_outcome(ticket))
                continue
            self._open[ticket] = job
            ticket.outcome.add_done_callback(
                functools.partial(self._answered, ticket, request_id))
        self._check_finished()

    def _answered(self, ticket: TicketView, request_id: str,
                  outcome: asyncio.Future[Outcome]) -> None:
        job = self._open.pop(ticket, None)
        if job is None or outcome.cancelled():
            return  # withdrawn: a rerun answers it
        worker_reply = ticket.worker_reply
        if worker_reply is not None:
            self.state.worker_answers += 1
            self.state.batch_size_sum += worker_reply.batch_size
        scored = worker_reply.weights if worker_reply is not None else ""
        self.record(job, request_id, responses.from_outcome(outcome.result()), scored)
        self._feed()

    def _check_finished(self) -> None:
        if not self._open and (self._stop.is_set() or not self._pending):
            self._finished.set()

    def record(self, job: Job, request_id: str, reply: responses.Reply,
               weights: str = "") -> None:
        """Write one job's answer (as its route shapes it), with the weights that scored it
        ("": none did), and count it."""
        reply = finish(job, reply)
        self._write(answered_line(job.custom_id, request_id, reply,
                                  weights if reply.status == 200 else ""))
        self.state.statuses[reply.status] += 1
        self._on_answer()

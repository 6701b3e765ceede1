"""The dispatch package's one entry: submit a request, get its outcome.

Both drivers hold a `Dispatcher`: `clef-serve`'s pipeline submits each validated HTTP request,
`clef-batch` submits its input lines. Behind it the workers are started, fed, judged, replaced
and stopped by one policy, whoever drives:

- admission (`admission.py`): a request goes to the next worker with room, or waits;
- liveness (`worker_channel.py`): a worker silent for `--stall-timeout` while the front waits on
  it, or that leaves a request unanswered for `--request-timeout`, is stuck: its stack is
  logged, then it is killed;
- restart (`supervisor.py`, `backoff.py`): a lost worker is replaced, after a back-off only in a
  crash loop;
- suspicion (`liveness.py`): a worker whose pong or reply is overdue by a short margin drawn
  from its recent forwards is suspect: no new work for it, and what it holds is sent again at
  once by the resend-alone rule (the first answer wins); it is healthy again when it answers;
- resend-alone (`admission.py`): the requests a lost worker held are sent again, once, each
  alone, so a poison request costs only its own answer (500);
- give-up (`settings.WorkerSettings.max_restarts`): never for the server; clef-batch stops after
  that many replacements, and its rerun resumes.

The drivers differ only in what they ask while no worker is warm: the server answers new
requests 503 at once (`wait_for_workers=False`), clef-batch's lines wait for the replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from clef_dispatch.admission import Admission, AdmissionEvents, Ticket
from clef_dispatch.settings import WorkerSettings
from clef_dispatch.supervisor import StartupFailed, Supervisor
from clef_dispatch.worker_pool import WorkerPool
from clef_frontend.load import TokenEstimate
from clef_frontend.priority import INTERACTIVE

# What a driver needs besides the Dispatcher, importable from here.
__all__ = ["DispatchEvents", "Dispatcher", "StartupFailed", "Ticket", "WorkerSettings"]


def _never_gone() -> bool:
    return False


def _nothing() -> None:
    """Default for `DispatchEvents.ready`."""


def _ignore(_: str) -> None:
    """Default for the events that carry a word."""


@dataclass(frozen=True)
class DispatchEvents:
    """What the driver hears: a worker became ready (first start, restart, reload), a warm
    worker was lost (its reason: crash, hung, stalled, protocol, cuda_error), a request was
    sent again (the reason), a waiting request's deadline passed (its class), a worker slot
    gave up (why), and a worker became suspect (clef_dispatch/liveness.py)."""

    ready: Callable[[], None] = _nothing
    worker_failed: Callable[[str], None] = _ignore
    resent: Callable[[str], None] = _ignore
    expired: Callable[[str], None] = _ignore
    gave_up: Callable[[str], None] = _ignore
    suspect: Callable[[], None] = _nothing


class Dispatcher:
    """The workers and the queue in front of them, as one unit."""

    def __init__(self, settings: WorkerSettings, *, queue_size: int, retry_after: int = 1,
                 queue_timeout: float | None = None, events: DispatchEvents | None = None,
                 wait_for_workers: bool = False,
                 estimate: TokenEstimate | None = None) -> None:
        self.settings = settings
        self._events = events or DispatchEvents()
        self._wait_for_workers = wait_for_workers
        self.pool = WorkerPool(settings, on_all_lost=self._all_lost, on_ready=self._ready,
                               on_worker_failed=self._events.worker_failed,
                               on_gave_up=self._events.gave_up, on_suspect=self._suspect)
        self.admission = Admission(
            capacity=queue_size, retry_after=retry_after, workers=self.pool,
            queue_timeout=queue_timeout, resend_timeout=settings.request_timeout,
            events=AdmissionEvents(resent=self._events.resent, expired=self._events.expired),
            wait_for_workers=wait_for_workers, estimate=estimate,
        )

    async def start(self) -> None:
        """Start every worker and wait for all to be ready; StartupFailed (none left running)
        when one cannot start: the operator must see why before anything is served."""
        await self.pool.start()

    def submit(self, body: bytes, request_id: str = "", *, trace_id: str = "",
               priority: str = INTERACTIVE, deadline: float | None = None,
               gone: Callable[[], bool] = _never_gone) -> Ticket:
        """Queue a checked body; its `Ticket.outcome` resolves to the reply (Refused: 503)."""
        return self.admission.submit(body, request_id, trace_id=trace_id, priority=priority,
                                     deadline=deadline, gone=gone)

    async def supervise(self) -> None:
        """Replace failed workers until cancelled (or until every slot gave up)."""
        await self.pool.watch()

    async def stop(self, grace: float | None = None) -> None:
        """Stop every worker: `shutdown`, then SIGKILL after `grace` (default
        `--shutdown-grace`; 0 kills at once)."""
        await self.pool.stop(grace)

    def _all_lost(self) -> None:
        """The last ready worker is gone: the server refuses what waits rather than make it
        wait a whole warm-up; clef-batch's lines wait (resent requests always do)."""
        if not self._wait_for_workers:
            self.admission.refuse_waiting("worker is restarting", resent_too=False)

    def _suspect(self, lane: Supervisor, suspect: bool) -> None:
        """A worker became suspect (what it holds goes elsewhere) or answered again."""
        if suspect:
            self._events.suspect()
        self.admission.lane_suspect(lane, suspect)

    def _ready(self) -> None:
        """A worker became ready: the driver hears of it first, then waiting tickets go."""
        self._events.ready()
        self.admission.pump()

"""The dispatch package's one entry: submit a request, get its outcome.

Both drivers hold a `Dispatcher`: `clef-serve`'s pipeline submits each validated HTTP request,
`clef-batch` submits its input lines. Behind it the workers are started, fed, judged, replaced
and stopped by one policy, whoever drives:

- admission (`admission.py`): a request goes to the next worker with room, or waits;
- liveness (`liveness_timer.py` applies `liveness.py`'s rule; `worker_channel.py` keeps the
  request deadlines): a worker silent for `--stall-timeout` while the front waits on it, or
  that leaves a request unanswered for `--request-timeout`, is stuck: its stack is logged
  (`worker_process.py`), then it is killed;
- restart (`supervisor.py`, `backoff.py`): a lost worker is replaced, after a back-off only in a
  crash loop;
- suspicion (`liveness.py`, `resend.py`): a worker whose pong or reply is overdue by a short
  margin drawn from its recent forwards is suspect: no new work for it, and each request it
  holds gets one copy, queued at the head of its class and sent by the ordinary rule beside new
  traffic while its own copy stays in flight (the first answer wins; a request lost with both
  workers is then sent again alone, so a second loss still isolates it); it is healthy again
  when it answers, and takes back the copies still queued;
- resend-alone (`resend.py`): the requests a lost worker held are sent again, once, each
  alone, so a poison request costs only its own answer (500);
- give-up (`settings.WorkerSettings.max_restarts`): never for the server; clef-batch stops after
  that many replacements, and its rerun resumes.

What a driver sees is this class and the outcome types (`outcomes.py`): `submit` gives a
read-only `TicketView` (its `outcome`, an `Answer` or a `Refusal`; its timings; `at_worker`,
whether a worker holds it, which answer sharing asks), or the `Refusal` at once when the request
cannot be queued; `abandon` drops a request whose caller left, `drain` lets what was admitted
finish, and `snapshot` (for `/health`) and the gauge reads report the state; the pool,
the supervisors and the queue behind it are never reached into.

The drivers differ only in what they ask while no worker is warm: the server answers new
requests 503 at once (`wait_for_workers=False`), clef-batch's lines wait for the replacement.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clef_dispatch.admission import Admission, AdmissionEvents
from clef_dispatch.load import TokenEstimate
from clef_dispatch.outcomes import Refusal
from clef_dispatch.settings import WorkerSettings
from clef_dispatch.supervisor import Supervisor
from clef_dispatch.ticket import TicketView, ticket_of
from clef_dispatch.urgency import INTERACTIVE
from clef_dispatch.worker_pool import WorkerPool, prefix_cache_of
from clef_protocol.messages import ReadyInfo

log = logging.getLogger("clef_dispatch.dispatcher")


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


@dataclass(frozen=True)
class DispatchSnapshot:
    """The dispatch state at one moment, as `/health` shows it.

    `state`: ready, starting, restarting, stopped or draining; `worker`: the first ready
    worker's ready frame; `workers`: one entry per worker slot (WorkerPool.describe).
    """

    state: str
    worker: ReadyInfo | None
    workers: list[dict[str, Any]]
    ready_workers: list[str]
    suspect_workers: list[str]
    waiting_for: str | None
    queue_depth: int
    in_flight: int
    queue_capacity: int
    restarts: int


class Dispatcher:
    """The workers and the queue in front of them, as one unit."""

    def __init__(self, settings: WorkerSettings, *, queue_size: int, retry_after: int = 1,
                 queue_timeout: float | None = None, events: DispatchEvents | None = None,
                 wait_for_workers: bool = False,
                 estimate: TokenEstimate | None = None) -> None:
        self.settings = settings
        self._events = events or DispatchEvents()
        self._wait_for_workers = wait_for_workers
        self._pool = WorkerPool(settings, on_all_lost=self._all_lost, on_ready=self._ready,
                                on_worker_failed=self._events.worker_failed,
                                on_gave_up=self._events.gave_up, on_suspect=self._suspect)
        self._admission = Admission(
            capacity=queue_size, retry_after=retry_after, workers=self._pool,
            queue_timeout=queue_timeout, resend_timeout=settings.request_timeout,
            events=AdmissionEvents(resent=self._events.resent, expired=self._events.expired),
            wait_for_workers=wait_for_workers, estimate=estimate,
        )

    # -- life ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait for all to be ready; StartupFailed (none left running)
        when one cannot start: the operator must see why before anything is served."""
        await self._pool.start()

    async def supervise(self) -> None:
        """Replace failed workers until cancelled (or until every slot gave up)."""
        await self._pool.watch()

    async def reload(self) -> None:
        """Roll every worker onto the snapshot now at --model, one at a time."""
        await self._pool.reload()

    async def stop(self, grace: float | None = None) -> None:
        """Stop every worker: `shutdown`, then SIGKILL after `grace` (default
        `--shutdown-grace`; 0 kills at once)."""
        await self._pool.stop(grace)

    # -- requests --------------------------------------------------------------------------

    def submit(self, body: bytes, request_id: str = "", *, trace_id: str = "",
               priority: str = INTERACTIVE, deadline: float | None = None,
               gone: Callable[[], bool] = _never_gone,
               affinity: bytes | None = None, model: str = "") -> TicketView | Refusal:
        """Queue a checked body: a read-only `TicketView` whose `outcome` resolves to its
        Answer or Refusal, or the Refusal (UNAVAILABLE) at once when it cannot be queued.
        `affinity`: its prefix key (`prefix_key`), so a state's requests go to the worker
        whose cache may hold it; `model`: the fine-tuned variant the body asks for ("": the
        base), so only a worker serving it gets it."""
        ticket = self._admission.submit(body, request_id, trace_id=trace_id, priority=priority,
                                        deadline=deadline, gone=gone, affinity=affinity,
                                        model=model)
        return ticket if isinstance(ticket, Refusal) else TicketView(ticket)

    def abandon(self, ticket: TicketView) -> None:
        """The caller has gone: a waiting ticket leaves the queue; one in flight finishes."""
        self._admission.abandon(ticket_of(ticket))

    @property
    def draining(self) -> bool:
        return self._admission.draining

    async def drain(self, timeout: float, cut_short: asyncio.Event | None = None) -> None:
        """Take nothing new, and wait up to `timeout` (or until `cut_short` is set) for what
        was admitted to be answered; what still waits then is refused (UNAVAILABLE)."""
        admission = self._admission
        admission.start_draining()
        log.info("draining: %d queued, %d in flight (up to %gs)", admission.depth,
                 admission.in_flight, timeout)
        waits: set[asyncio.Future[Any]] = {asyncio.ensure_future(admission.wait_idle())}
        if cut_short is not None:
            waits.add(asyncio.ensure_future(cut_short.wait()))
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if admission.depth or admission.in_flight:
            log.warning("drain cut short: %d queued requests get 503", admission.depth)
            admission.refuse_waiting("server is draining")

    async def wait_idle(self) -> None:
        """Return once nothing waits and nothing is in flight."""
        await self._admission.wait_idle()

    # -- what the driver reads -------------------------------------------------------------

    def snapshot(self) -> DispatchSnapshot:
        """The state for `/health` (built on the event loop, where the state changes)."""
        pool, admission = self._pool, self._admission
        return DispatchSnapshot(
            state="draining" if admission.draining else str(pool.state()),
            worker=pool.ready_info(),
            workers=pool.describe(),
            ready_workers=[lane.slot.name for lane in pool.ready_lanes()],
            suspect_workers=[lane.slot.name for lane in pool.suspect_lanes()],
            waiting_for=pool.waiting_on_suspects(),
            queue_depth=admission.depth,
            in_flight=admission.in_flight,
            queue_capacity=admission.capacity,
            restarts=pool.restarts,
        )

    # The gauges' reads (a scrape may run them on the metrics port's thread; each is safe to).

    def depth_of(self, priority: str) -> int:
        return self._admission.depth_of(priority)

    @property
    def depth(self) -> int:
        return self._admission.depth

    @property
    def in_flight(self) -> int:
        return self._admission.in_flight

    @property
    def in_flight_since(self) -> float | None:
        return self._admission.in_flight_since

    @property
    def tokens_outstanding(self) -> int:
        """Estimated tokens waiting and in flight (the utilisation gauge's numerator)."""
        return self._admission.tokens_outstanding

    @property
    def ready(self) -> bool:
        return self._pool.unavailable_reason() is None

    def ready_info(self) -> ReadyInfo | None:
        return self._pool.ready_info()

    def ready_infos(self) -> list[ReadyInfo]:
        """The `ready` frame of each ready worker."""
        return [lane.info for lane in self._pool.ready_lanes() if lane.info is not None]

    @property
    def restarts(self) -> int:
        return self._pool.restarts

    def prefix_caches(self) -> list[tuple[str, dict[str, Any]]]:
        """Each ready worker's prefix cache (`worker_pool.prefix_cache_of`) by slot name; the
        workers without one are left out."""
        caches = []
        for lane in self._pool.ready_lanes():
            cache = prefix_cache_of(lane)
            if cache is not None:
                caches.append((lane.slot.name, cache))
        return caches

    def serves_weights(self, model: str, weights: str) -> bool:
        """Whether a ready worker serves `model` ("": the base) with the fingerprint `weights`
        now: an answer kept for repeats is served only while one does."""
        return self._pool.serves_weights(model, weights)

    def takes_now(self, model: str) -> bool:
        """Whether a request for `model` ("": the base) admitted now would go to a worker at
        once: a request with its own deadline then runs on its own rather than wait on an
        identical request's forward already under way (answer sharing)."""
        return self._admission.takes_now(model)

    def variant_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The fine-tuned variants ready workers serve, and every variant a worker served at
        its last `ready` (the catalogue: listed and admitted, or 503 while none serving it is
        ready, or unknown)."""
        return self._pool.variant_names()

    # -- the pool's events -----------------------------------------------------------------

    def _all_lost(self) -> None:
        """The last ready worker is gone: the server refuses what waits rather than make it
        wait a whole warm-up; clef-batch's lines wait (resent requests always do)."""
        if not self._wait_for_workers:
            self._admission.refuse_waiting("worker is restarting", resent_too=False)

    def _suspect(self, lane: Supervisor, suspect: bool) -> None:
        """A worker became suspect (what it holds goes elsewhere) or answered again."""
        if suspect:
            self._events.suspect()
        self._admission.lane_suspect(lane, suspect)

    def _ready(self) -> None:
        """A worker became ready: the driver hears of it first, then waiting tickets go."""
        self._events.ready()
        self._admission.pump()

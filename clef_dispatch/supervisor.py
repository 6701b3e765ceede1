"""Keep one worker slot warm: start its worker, notice when it fails, replace it with backoff,
stop it.

One Supervisor per worker slot (`worker_pool.py` holds one per device and per
`--workers-per-device`); each slot is also an admission lane: `has_room` and `submit` let up to
`max_batch` requests be outstanding on its worker, and `reload` swaps in a fresh worker with no
gap (the new one is warm before the old one is retired).

Like gunicorn's arbiter, but for the one child of this slot, which must be warm before it counts
(the pool runs a Supervisor per slot, so the server may have many workers): a worker
is only `ready` after its `ready` frame. The first start is special: if it fails the operator
must see why and the server must not bind its port, so `start()` raises. Later failures are
survived: the state goes to `restarting` (so `/health` and admission refuse with 503), and a new
worker is started after an exponential backoff until one sends `ready` again: forever for the
server, at most `max_restarts` times for clef-batch, which then gives up (its rerun resumes).
A replacement that sends `fatal` is retried the same way (a passing cause, such as a GPU still
held by the dead worker, should not need an operator), and every attempt is logged. The backoff
grows only in a crash loop: a worker that answered a request before dying resets it
(backoff.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from clef_dispatch.backoff import RestartBackoff
from clef_dispatch.liveness import ForwardRates, Judgement
from clef_dispatch.settings import WorkerSettings
from clef_dispatch.worker_channel import WorkerChannel
from clef_dispatch.worker_errors import (
    Deliver,
    WorkerFailure,
    WorkerOutcome,
    WorkerUnavailable,
    failure_reason,
)
from clef_protocol.messages import PrefixStats, ReadyInfo, Request, Weights, WorkerReply

log = logging.getLogger("clef_dispatch.supervisor")


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPED = "stopped"


class StartupFailed(Exception):
    """The first worker did not become ready; str() is the reason for the operator."""


@dataclass(frozen=True)
class WorkerSlot:
    """Where one worker runs: its name in logs and /health, its device, its command and env."""

    name: str
    device: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def _ignore() -> None:
    """Default for the optional callbacks."""


class Supervisor:
    """Owns one worker process; `submit` is the only way requests reach it."""

    def __init__(
        self,
        config: WorkerSettings,
        on_worker_lost: Callable[[], None],
        *,
        slot: WorkerSlot | None = None,
        on_ready: Callable[[], None] = _ignore,
        on_worker_failed: Callable[[str], None] | None = None,
        on_gave_up: Callable[[str], None] | None = None,
        on_suspect: Callable[[Supervisor, bool], None] | None = None,
    ) -> None:
        self._config = config
        self._on_suspect = on_suspect
        self._on_worker_lost = on_worker_lost
        self._on_ready = on_ready
        self._on_worker_failed = on_worker_failed
        self._on_gave_up = on_gave_up
        self.slot = slot or WorkerSlot("0", "default", config.worker_argv)
        self.max_batch = 1  # until its worker's `ready` says
        self._backoff = RestartBackoff(
            config.restart_backoff, config.restart_backoff_max, config.restart_reset_after
        )
        self._failures = 0  # workers lost and replacements failed, for `max_restarts`
        self.gave_up: str | None = None  # why the slot stopped replacing its worker
        self._channel: WorkerChannel | None = None
        self._rates = ForwardRates()  # this slot's recent forwards, across its workers
        self._ready_at = 0.0
        self._served = 0  # successful answers of the current worker (see backoff.py)
        self.state = WorkerState.STARTING
        self.info: ReadyInfo | None = None
        # The prefix cache's figures as the current worker's latest reply left them (None
        # before its first reply that carried them): /health and the metrics read them here.
        self.prefix_stats: PrefixStats | None = None
        # What its worker serves, by fingerprint (the `Weights` of its last `ready`: the one
        # description routing, the catalogue, the answer cache and clef-batch read; kept while
        # it restarts, so the front still knows the variants' names).
        self.weights = Weights()
        self.restarts = 0

    async def start(self) -> ReadyInfo:
        """Start the first worker and wait for `ready`; raise StartupFailed otherwise."""
        try:
            await self._launch()
        except WorkerFailure as exc:
            self.state = WorkerState.STOPPED
            raise StartupFailed(str(exc)) from None
        assert self.info is not None
        return self.info

    def unavailable_reason(self) -> str | None:
        """None when requests may be forwarded, else the 503 detail."""
        if self.state is WorkerState.READY and self._channel is not None:
            if not self._channel.is_broken:
                return None
            return "worker is restarting"
        return {
            WorkerState.STARTING: "worker is starting",
            WorkerState.RESTARTING: "worker is restarting",
        }.get(self.state, "server is shutting down")

    def has_room(self) -> bool:
        """Ready, not suspect, and fewer than `max_batch` requests outstanding on the worker."""
        channel = self._channel
        return (self.state is WorkerState.READY and channel is not None
                and not channel.is_broken and channel.suspect is None
                and channel.in_flight < self.max_batch)

    @property
    def variants(self) -> Mapping[str, str]:
        """The fine-tuned variants its worker serves, by name, with their fingerprints."""
        return self.weights.variants

    def serves(self, model: str) -> bool:
        """Whether its worker serves `model` (a variant's name; "" is the base, which every
        worker serves): a request is sent only to a worker that serves its model."""
        return not model or model in self.weights.variants

    def weights_of(self, model: str) -> str | None:
        """The fingerprint its worker serves `model` with (None: it does not serve it)."""
        if not model and self.info is None:
            return None
        return self.weights.of(model)

    @property
    def suspect(self) -> Judgement | None:
        """Why the warm worker is suspect (liveness.py), or None: it gets no new work meanwhile."""
        channel = self._channel
        return None if channel is None or self.state is not WorkerState.READY else channel.suspect

    @property
    def suspect_for(self) -> float:
        """Seconds the worker has been suspect (0: it is not)."""
        return 0.0 if self.suspect is None or self._channel is None else self._channel.suspect_for

    @property
    def in_flight(self) -> int:
        return 0 if self._channel is None else self._channel.in_flight

    @property
    def prefix_slot(self) -> str | None:
        """The slot's name while its warm worker keeps a prefix cache turned on (its `ready`
        says so), for the prefix affinity rule (affinity.py); else None."""
        info = self.info
        if self.state is not WorkerState.READY or info is None or info.prefix_cache is None:
            return None
        return self.slot.name if info.prefix_cache.enabled else None

    def submit(self, request: Request, deliver: Deliver) -> None:
        """Send one request to the warm worker; `deliver` gets its reply or its failure.

        Raises WorkerUnavailable (nothing was sent) when the worker is not warm.
        """
        reason = self.unavailable_reason()
        if reason is not None:
            raise WorkerUnavailable(reason)
        channel = self._channel
        assert channel is not None

        def answered(outcome: WorkerOutcome) -> None:
            if (isinstance(outcome, WorkerReply) and outcome.status == 200
                    and channel is self._channel):
                self._served += 1  # useful work: resets the restart backoff (backoff.py)
                if outcome.prefix is not None:
                    self.prefix_stats = outcome.prefix
            deliver(outcome)

        channel.submit(request, self._config.request_timeout, answered)

    async def watch(self) -> None:
        """Run until cancelled: each time the worker fails, replace it (with backoff); return
        only when `max_restarts` replacements are spent (the slot gave up)."""
        while True:
            channel = self._channel
            assert channel is not None
            failure = await channel.broken()
            if channel is not self._channel:  # retired by a reload: its successor is watched
                continue
            uptime = time.monotonic() - self._ready_at
            self.state = WorkerState.RESTARTING
            self._on_worker_lost()
            dead = self._channel
            code = await asyncio.shield(dead.kill())
            reason = failure_reason(failure, code)
            log.error("worker pid=%d failed after %.1fs and %d answers: %s (exit code %s, "
                      "reason=%s)", dead.pid, uptime, self._served, failure, code, reason)
            if self._on_worker_failed is not None:
                self._on_worker_failed(reason)
            decision = self._backoff.worker_died(uptime=uptime, served=self._served)
            while True:
                self._failures += 1
                if self._spent():
                    self._give_up(f"worker {self.slot.name} failed {self._failures} times "
                                  f"(--max-restarts {self._config.max_restarts}); last: "
                                  f"{failure}")
                    return
                log.warning("starting a new worker in %.2fs (%s)", decision.delay, decision.reason)
                await asyncio.sleep(decision.delay)
                try:
                    await self._launch()
                except WorkerFailure as exc:
                    log.error("replacement worker failed to start: %s", exc)
                    failure = exc
                    decision = self._backoff.start_failed()
                    continue
                break
            self.restarts += 1

    def _spent(self) -> bool:
        limit = self._config.max_restarts
        return limit is not None and self._failures > limit

    def _give_up(self, reason: str) -> None:
        """No more replacements: the slot stays stopped, and the driver hears why."""
        self.state = WorkerState.STOPPED
        self.gave_up = reason
        log.error("giving up on worker %s: %s", self.slot.name, reason)
        if self._on_gave_up is not None:
            self._on_gave_up(reason)

    async def stop(self, grace: float | None = None) -> None:
        """Send `shutdown`, let the worker finish the requests it holds (up to `grace`, by
        default `--shutdown-grace`), reap it."""
        self.state = WorkerState.STOPPED
        channel, self._channel = self._channel, None
        if channel is None:
            return
        code = await channel.stop(self._config.shutdown_grace if grace is None else grace)
        log.info("worker pid=%d stopped (exit code %s)", channel.pid, code)

    async def reload(self) -> bool:
        """Replace a ready worker by a fresh one with no gap; False (old one kept) on failure.

        The new worker loads whatever snapshot is at --model now and warms up while the old one
        keeps serving; then new requests go to the new one, and the old one answers what it
        holds (it reads `shutdown` after them) and exits.
        """
        old = self._channel
        if self.state is not WorkerState.READY or old is None or old.is_broken:
            log.warning("worker %s: not ready, not reloaded (a restart loads the snapshot anyway)",
                        self.slot.name)
            return False
        try:
            channel, info = await self._spawn_ready()
        except WorkerFailure as exc:
            log.error("worker %s: reload failed, the old worker keeps serving: %s",
                      self.slot.name, exc)
            return False
        if self._channel is not old or self.state is not WorkerState.READY:
            await asyncio.shield(channel.stop(self._config.shutdown_grace))  # lost a race
            return False
        self._adopt(channel, info)
        code = await old.stop(self._config.shutdown_grace)
        log.info("worker %s: reloaded, old worker pid=%d retired (exit code %s)",
                 self.slot.name, old.pid, code)
        return True

    async def _spawn_ready(self) -> tuple[WorkerChannel, ReadyInfo]:
        """Spawn a worker and wait for its `ready`; on any failure it is killed and reaped."""
        channel = await WorkerChannel.spawn(self.slot.argv, self.slot.env)
        pinned = " ".join(f"{k}={v}" for k, v in self.slot.env.items())
        log.info("started worker pid=%d slot=%s: %s%s", channel.pid, self.slot.name,
                 f"{pinned} " if pinned else "", " ".join(self.slot.argv))
        try:
            info = await channel.wait_ready(self._config.startup_timeout)
        except BaseException:
            await asyncio.shield(channel.kill())
            raise
        channel.watch_liveness(self._config.stall_timeout, pings=info.pings, rates=self._rates,
                               on_suspect=lambda suspect: self._suspicion(channel, suspect))
        return channel, info

    def _suspicion(self, channel: WorkerChannel, suspect: bool) -> None:
        """The worker became suspect (or healthy again): log it and tell the pool."""
        if channel is not self._channel:
            return  # a retired worker finishing what it holds: no longer this slot's concern
        judgement = channel.suspect
        if suspect and judgement is not None:
            log.warning("worker %s pid=%d is suspect: %s; no new work for it, its %d request(s) "
                        "may be answered elsewhere (killed after %.1fs of silence)",
                        self.slot.name, channel.pid, judgement.reason, channel.in_flight,
                        judgement.kill_after)
        elif not suspect:
            log.info("worker %s pid=%d answered again: healthy", self.slot.name, channel.pid)
        if self._on_suspect is not None:
            self._on_suspect(self, suspect)

    async def _launch(self) -> None:
        """Spawn a worker, wait for `ready`, and make it this slot's worker."""
        self._adopt(*await self._spawn_ready())

    def _adopt(self, channel: WorkerChannel, info: ReadyInfo) -> None:
        self._channel, self.info = channel, info
        self.prefix_stats = None  # a new worker starts with an empty cache
        self.weights = info.weights
        # Requests outstanding on this worker: what it reported in `ready` (`max_sequences`,
        # `--max-batch` or its device's default: the worker owns the batch policy,
        # clef_worker.serving.policy, and the front reads it from `ready` only).
        self.max_batch = info.requests_per_forward
        self._ready_at = time.monotonic()
        self._served = 0
        self.state = WorkerState.READY
        log.info(
            "worker ready: slot=%s max_batch=%d pid=%d thread=%s model=%s variant=%s device=%s "
            "dtype=%s gdn_path=%s short_conv=%s warmup_ms=%.1f cuda_graphs=%s buckets=%d "
            "captured=%d graph_memory_bytes=%d ready_s=%s%s",
            self.slot.name, self.max_batch, info.pid, info.thread, info.model, info.variant,
            info.device, info.dtype, info.gdn_path, info.short_conv, info.warmup_ms,
            info.cuda_graphs,
            len(info.buckets), info.shapes, info.graph_memory_bytes,
            "-" if info.startup is None else f"{info.startup.ready_s:.1f}",
            "" if info.startup is None else "".join(
                f" {name}={seconds:.1f}" for name, seconds in info.startup.phases.items()),
        )
        self._on_ready()
        if info.demo:
            log.warning(
                "DEMO SNAPSHOT: this worker runs a tiny randomly initialised model; its answers "
                "are meaningless and must not be used for decisions"
            )

"""Keep one warm worker: start it, notice when it fails, replace it with backoff, stop it.

Like gunicorn's arbiter, but for exactly one child that must be warm before it counts: a worker
is only `ready` after its `ready` frame. The first start is special: if it fails the operator
must see why and the server must not bind its port, so `start()` raises. Later failures are
survived: the state goes to `restarting` (so `/health` and admission refuse with 503), and a new
worker is started after an exponential backoff, forever, until one sends `ready` again. A
replacement that sends `fatal` is retried the same way (a passing cause, such as a GPU still held
by the dead worker, should not need an operator), and every attempt is logged. The backoff grows
only in a crash loop: a worker that answered a request before dying resets it (backoff.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from enum import StrEnum

from clef_frontend.backoff import RestartBackoff
from clef_frontend.config import ServerConfig
from clef_frontend.worker_channel import WorkerChannel, WorkerReply, failure_reason
from clef_frontend.worker_errors import WorkerFailure, WorkerUnavailable
from clef_protocol.messages import ReadyInfo

log = logging.getLogger("clef_frontend.supervisor")


class WorkerState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    STOPPED = "stopped"


class StartupFailed(Exception):
    """The first worker did not become ready; str() is the reason for the operator."""


class Supervisor:
    """Owns the worker process; `forward` is the only way requests reach it."""

    def __init__(
        self,
        config: ServerConfig,
        on_worker_lost: Callable[[], None],
        on_worker_failed: Callable[[str], None] | None = None,
    ) -> None:
        self._config = config
        self._on_worker_lost = on_worker_lost
        self._on_worker_failed = on_worker_failed
        self._backoff = RestartBackoff(
            config.restart_backoff, config.restart_backoff_max, config.restart_reset_after
        )
        self._channel: WorkerChannel | None = None
        self._ready_at = 0.0
        self._served = 0  # successful answers of the current worker (see backoff.py)
        self.state = WorkerState.STARTING
        self.info: ReadyInfo | None = None
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

    async def forward(self, request_id: int, body: bytes, trace_id: str = "") -> WorkerReply:
        """Send one request to the warm worker and return its reply.

        Raises WorkerUnavailable (nothing was sent: answer 503) or WorkerFailure (the worker
        failed with this request in flight: answer 500).
        """
        reason = self.unavailable_reason()
        if reason is not None:
            raise WorkerUnavailable(reason)
        channel = self._channel
        assert channel is not None
        reply = await channel.call(request_id, body, self._config.request_timeout, trace_id)
        if reply.status == 200 and channel is self._channel:
            self._served += 1
        return reply

    async def watch(self) -> None:
        """Run until cancelled: each time the worker fails, replace it (with backoff)."""
        while True:
            assert self._channel is not None
            failure = await self._channel.broken()
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
                log.warning("starting a new worker in %.2fs (%s)", decision.delay, decision.reason)
                await asyncio.sleep(decision.delay)
                try:
                    await self._launch()
                except WorkerFailure as exc:
                    log.error("replacement worker failed to start: %s", exc)
                    decision = self._backoff.start_failed()
                    continue
                break
            self.restarts += 1

    async def stop(self) -> None:
        """Send `shutdown`, let the worker finish the request it holds, reap it."""
        self.state = WorkerState.STOPPED
        channel, self._channel = self._channel, None
        if channel is None:
            return
        code = await channel.stop(self._config.shutdown_grace)
        log.info("worker pid=%d stopped (exit code %s)", channel.pid, code)

    async def _launch(self) -> None:
        """Spawn a worker and wait for its `ready`; on any failure it is killed and reaped."""
        channel = await WorkerChannel.spawn(self._config.worker_argv)
        log.info("started worker pid=%d: %s", channel.pid, " ".join(self._config.worker_argv))
        try:
            info = await channel.wait_ready(self._config.startup_timeout)
        except BaseException:
            await asyncio.shield(channel.kill())
            raise
        self._channel, self.info = channel, info
        self._ready_at = time.monotonic()
        self._served = 0
        self.state = WorkerState.READY
        log.info(
            "worker ready: pid=%d thread=%s model=%s variant=%s device=%s dtype=%s gdn_path=%s "
            "warmup_ms=%.1f cuda_graphs=%s buckets=%d captured=%d graph_memory_bytes=%d",
            info.pid, info.thread, info.model, info.variant, info.device, info.dtype,
            info.gdn_path, info.warmup_ms, info.cuda_graphs, len(info.buckets),
            info.buckets_captured, info.graph_memory_bytes,
        )
        if info.demo:
            log.warning(
                "DEMO SNAPSHOT: this worker runs a tiny randomly initialised model; its answers "
                "are meaningless and must not be used for decisions"
            )

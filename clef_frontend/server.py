"""The server's life: start the worker, bind only once it is ready, serve, drain, stop.

Order matters and is the point of this module:
1. the worker is started and its `ready` awaited before the port is bound, so a load balancer
   never sees an open port that cannot answer, and a failed start exits non-zero unbound;
2. SIGTERM/SIGINT close the listener first, then let what is in flight and queued finish
   (bounded by the drain timeout; a second signal cuts it short) while existing connections
   are answered with `Connection: close` (`/health` says `draining`, new POSTs get 503), then
   ask the worker to shut down, reap it, close idle connections, and exit 0.
3. SIGHUP has one job: roll the workers, one at a time, onto the snapshot now at --model and the
   checkpoints now in the --finetune directories (kept answers are bound to the weights that
   made them, so none is flushed); it calls every callback registered with
   `on_reload`, so parts that need the roll hear of it. API keys need no signal: their file is
   watched and re-read when it changes (auth.py), without touching a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from clef_api.catalogue import Catalogue
from clef_dispatch import (
    Dispatcher,
    DispatchEvents,
    StartupFailed,
    TokenEstimate,
    utilisation_gauge,
)
from clef_frontend.answer_cache import AnswerCache
from clef_frontend.api import ApiSurface
from clef_frontend.auth import ApiKeys
from clef_frontend.config import ServerConfig
from clef_frontend.connection import READ_SIZE, ConnectionTimers, HttpConnection
from clef_frontend.health import Health
from clef_frontend.metrics import LiveState, Metrics
from clef_frontend.pipeline import Pipeline
from clef_frontend.sd_notify import Notifier, ServiceNotifier, making_progress, watchdog_interval
from clef_frontend.version import version

log = logging.getLogger("clef_frontend.server")

# After the worker has stopped, how long connections get to write their last replies.
FINAL_WRITE_SECONDS = 5.0


class FrontServer:
    """Wires supervisor, admission, health and connections together for one run."""

    def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self._dispatch = Dispatcher(
            config.workers, queue_size=config.queue_size, retry_after=config.retry_after,
            queue_timeout=config.queue_timeout,
            events=DispatchEvents(ready=self._worker_ready, worker_failed=self._worker_failed,
                                  resent=self._request_resent, expired=self._deadline_expired,
                                  suspect=self._worker_suspect),
            estimate=TokenEstimate(config.limits.max_length))
        dispatch = self._dispatch
        self._health = Health(dispatch.snapshot, config.retry_after)
        self._api = api_surface(config, live=dispatch.variant_names)
        # A kept answer is served (and a forward's answer shared) only while a ready worker
        # serves its model with its weights; a request with its own deadline that a worker
        # would take at once runs on its own.
        self._cache = AnswerCache(config.answer_cache, config.answer_cache_bytes,
                                  config.queue_timeout, serving=dispatch.serves_weights,
                                  takes_now=dispatch.takes_now)
        self._metrics = Metrics(LiveState(
            queue_depth=dispatch.depth_of,
            in_flight=lambda: dispatch.in_flight,
            queue_capacity=config.queue_size,
            worker_ready=lambda: dispatch.ready,
            worker_info=dispatch.ready_info,
            queued=lambda: dispatch.depth,
            token_usage=utilisation_gauge(lambda: dispatch.tokens_outstanding,
                                          dispatch.ready_infos, config.limits.max_length),
            cache_bytes=lambda: self._cache.size_bytes,
            prefix_caches=dispatch.prefix_caches,
            cache_joiners=lambda: self._cache.joiners_waiting,
        ), version=version(), separate_port=config.metrics_port is not None)

        self._pipeline = Pipeline(config=config, dispatch=dispatch, health=self._health,
                                  metrics=self._metrics, api=self._api, cache=self._cache)
        self._address = ""
        self._systemd = ServiceNotifier(
            Notifier.from_environment(), status=self._service_status, healthy=self._healthy)
        self._connections: dict[HttpConnection, asyncio.Task[None]] = {}
        self._timers = ConnectionTimers.of(config)  # shared: one timer each, not one per read
        self._stop_requested = asyncio.Event()
        self._force_stop = asyncio.Event()
        self._reload_callbacks: list[Callable[[], Awaitable[None] | None]] = [
            self._roll_workers]
        self._reloads: set[asyncio.Future[None]] = set()

    def on_reload(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Run `callback` on every SIGHUP (a coroutine function is run as a task)."""
        self._reload_callbacks.append(callback)

    async def run(self) -> int:
        """Serve until a stop signal; the process exit status."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        watchdog = asyncio.create_task(self._systemd.watch(watchdog_interval()), name="sd-notify")
        key_watch = asyncio.create_task(self._api.keys.watch(), name="key-file")
        try:
            if self._config.metrics_port is not None and not self._serve_metrics():
                return 1
            if not await self._start_worker():
                return 1 if not self._stop_requested.is_set() else 0
            try:
                server = await asyncio.start_server(
                    self._serve_client, self._config.host, self._config.port, limit=READ_SIZE,
                    backlog=self._config.backlog, reuse_address=True,
                )
            except OSError as exc:
                log.error("cannot listen on %s:%d: %s", self._config.host, self._config.port, exc)
                return 1
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                shown = f"[{host}]" if ":" in host else host
                log.info("listening on http://%s:%d (backlog %d)", shown, port,
                         self._config.backlog)
                self._address = self._address or f"{shown}:{port}"
            # The socket is listening (connections queue in its backlog): only now is it READY.
            self._systemd.ready(self._address)
            watcher = asyncio.create_task(self._dispatch.supervise(), name="supervisor")
            await self._stop_requested.wait()
            await self._drain(server, watcher)
            log.info("stopped")
            return 0
        finally:
            watchdog.cancel()
            key_watch.cancel()
            for task in self._reloads:
                task.cancel()
            await self._dispatch.stop()
            self._metrics.close()

    def _serve_metrics(self) -> bool:
        """`--metrics-port`: metrics on their own port from the start (warm-up included)."""
        host, port = self._config.host, self._config.metrics_port
        assert port is not None
        try:
            bound = self._metrics.serve(host, port)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d: %s", host, port, exc)
            return False
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on http://%s:%d/metrics", shown, bound)
        return True

    def _service_status(self) -> str | None:
        """systemd's STATUS= line for the current state (None during the first start, whose
        status the start-up extensions carry)."""
        status = self._health.status()
        if status == "ready":
            return f"serving on {self._address}"
        if status == "starting":
            return None
        return "worker restarting" if status == "restarting" else status

    def _healthy(self) -> bool:
        """For the systemd watchdog: the worker is idle or within its request timeout."""
        return making_progress(self._dispatch.in_flight_since, self._config.workers.request_timeout,
                               time.monotonic())

    async def _start_worker(self) -> bool:
        """First start, abandoned if a stop signal arrives meanwhile."""
        starting = asyncio.create_task(self._dispatch.start())
        stopping = asyncio.create_task(self._stop_requested.wait())
        extending = asyncio.create_task(self._systemd.extend_while_starting())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        extending.cancel()
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            await asyncio.wait({starting})
            log.info("stopped during worker start-up")
            return False
        try:
            starting.result()
        except StartupFailed as exc:
            log.error("worker failed to start, not listening: %s", exc)
            return False
        return True

    async def _drain(self, server: asyncio.Server, watcher: asyncio.Task[None]) -> None:
        server.close()
        await self._dispatch.drain(self._config.drain_timeout, self._force_stop)
        watcher.cancel()
        await asyncio.wait({watcher})
        for task in self._reloads:
            task.cancel()
        # The worker answers what it holds before it reads `shutdown`, so an in-flight request
        # still gets its reply (or a 500 if the worker must be killed after the grace period).
        await self._dispatch.stop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._dispatch.wait_idle(), FINAL_WRITE_SECONDS)
        # Idle keep-alive connections stayed open during the drain, so probes on them could see
        # `draining` (every answer meanwhile said `Connection: close`); now they are closed.
        for connection in list(self._connections):
            connection.close_if_idle()
        tasks = set(self._connections.values())
        if tasks:
            await asyncio.wait(tasks, timeout=FINAL_WRITE_SECONDS)
        for task in tasks:
            task.cancel()

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        connection = HttpConnection(reader, writer, config=self._config,
                                    pipeline=self._pipeline, timers=self._timers)
        task = asyncio.current_task()
        assert task is not None
        self._connections[connection] = task
        try:
            await connection.run()
        finally:
            del self._connections[connection]

    def _worker_ready(self) -> None:
        """A worker became ready (first start, restart, reload), before it takes waiting
        tickets: it loaded whatever is at --model and in the --finetune directories now, and
        the worker it replaced no longer serves; kept answers of weights no ready worker
        serves now go (a hit checks the weights anyway: this frees their memory)."""
        dropped = self._cache.prune()
        if dropped:
            log.info("answer cache: %d kept answer(s) of weights no ready worker serves "
                     "dropped", dropped)

    async def _roll_workers(self) -> None:
        """SIGHUP's job: every worker, one at a time, onto what is at --model and in the
        --finetune directories now (variants added or removed); kept answers follow the
        weights each worker reports, so nothing is flushed."""
        await self._dispatch.reload()

    def reload(self) -> None:
        """What SIGHUP does: run every reload callback; one failing does not stop the others."""
        log.info("SIGHUP received: reloading")
        for callback in self._reload_callbacks:
            try:
                result = callback()
            except Exception:
                log.exception("a reload callback failed")
                continue
            if result is not None:
                task = asyncio.ensure_future(result)
                self._reloads.add(task)
                task.add_done_callback(self._reload_done)

    def _reload_done(self, task: asyncio.Future[None]) -> None:
        self._reloads.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a reload failed", exc_info=task.exception())

    def _worker_failed(self, reason: str) -> None:
        self._metrics.worker_failed(reason)

    def _worker_suspect(self) -> None:
        self._metrics.worker_suspect()

    def _request_resent(self, reason: str) -> None:
        self._metrics.request_resent(reason)

    def _deadline_expired(self, priority: str) -> None:
        self._metrics.expired(priority)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._stop_requested.is_set():
            log.warning("%s again: not waiting for queued requests", name)
            self._force_stop.set()
        else:
            log.info("%s received: stopping", name)
            self._systemd.stopping()
            self._stop_requested.set()


def api_surface(config: ServerConfig,
                live: Callable[[], tuple[tuple[str, ...], tuple[str, ...]]] | None = None,
                ) -> ApiSurface:
    """Keys and served names from the config, the variants as the workers serve them (`live`);
    KeyFileError if the key file is unusable."""
    key_file = Path(config.api_key_file) if config.api_key_file is not None else None
    keys = ApiKeys(key_file, config.api_key)
    if keys.enabled:
        log.info("API keys required: %d key(s) in force%s", keys.count,
                 f", watching {key_file} for changes" if key_file is not None else "")
    return ApiSurface(keys=keys, catalogue=Catalogue(
        config.served_model_names, variants=config.finetune_names,
        live=live if config.finetune else None, retry_after=config.retry_after,
        finetune=config.finetune))


async def serve(config: ServerConfig) -> int:
    """Run one server to completion; the exit status."""
    return await FrontServer(config).run()

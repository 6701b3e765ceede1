"""Every worker of the server: one per device (times `--workers-per-device`), each on its own.

Why several: one GPU serves one model forward at a time, so a host with more GPUs needs a worker
on each; and with two workers a crash (or a reload) is no longer an outage, because the other
keeps serving while the replacement warms up. Each worker has its own Supervisor (start,
restart with backoff, stop) and is pinned to its GPU with `CUDA_VISIBLE_DEVICES`, so inside the
worker that GPU is `cuda:0` and nothing else is visible. The pool is what admission sees: it is
available while at least one worker is ready, and its lanes are the supervisors themselves.

Workers not pinned to a GPU (CPU workers, or several on one `--device`) share the host's cores:
each would otherwise start one OpenMP thread per core, and their spinning threads fight over the
same cores. Measured on a 2-core host with two CPU workers: 5-12 requests/s at 8 clients with
torch's default threads, 142 with one thread each (docs/benchmarks.md). So each such worker gets
`OMP_NUM_THREADS` = cores / workers, unless the operator set `OMP_NUM_THREADS` themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from clef_dispatch.settings import WorkerSettings
from clef_dispatch.supervisor import StartupFailed, Supervisor, WorkerSlot, WorkerState
from clef_protocol.messages import ReadyInfo
from clef_protocol.options import parse_device

log = logging.getLogger("clef_dispatch.worker_pool")


def plan_slots(config: WorkerSettings) -> list[WorkerSlot]:
    """The worker slots for a config: names, devices, command lines and environments.

    A `cuda:N` device runs its worker with `CUDA_VISIBLE_DEVICES=N` and `--device cuda` (the
    last `--device` on a command line wins); any other device is passed as `--device` as is.
    Without `devices`, one worker runs the configured command unchanged.
    """
    per_device = config.workers_per_device
    if not config.devices:
        shared = shared_core_env(per_device)
        return [WorkerSlot(str(i), "default", config.worker_argv, dict(shared))
                for i in range(per_device)]
    gpus = {device: parse_device(device).index for device in config.devices}
    unpinned = sum(per_device for device in config.devices if gpus[device] is None)
    shared = shared_core_env(unpinned)
    slots = []
    for device in config.devices:
        env: dict[str, str] = {}
        shown = device
        index = gpus[device]
        if index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
            device_flag = "cuda"
        else:
            env.update(shared)
            device_flag = device
        argv = (*config.worker_argv, "--device", device_flag)
        for i in range(per_device):
            name = shown if per_device == 1 else f"{shown}#{i}"
            slots.append(WorkerSlot(name, shown, argv, dict(env)))
    return slots


def host_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's share, not the
    machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def shared_core_env(workers: int, environ: Mapping[str, str] = os.environ,
                    cores: int | None = None) -> dict[str, str]:
    """The environment that splits the host's cores among `workers` unpinned workers: empty
    for one worker, or when the operator set OMP_NUM_THREADS."""
    if workers <= 1 or "OMP_NUM_THREADS" in environ:
        return {}
    threads = max(1, (cores or host_cores()) // workers)
    log.info("%d workers share %d cores: OMP_NUM_THREADS=%d each (set OMP_NUM_THREADS to "
             "choose)", workers, cores or host_cores(), threads)
    return {"OMP_NUM_THREADS": str(threads)}


def prefix_cache_of(lane: Supervisor) -> dict[str, Any] | None:
    """A worker's prefix cache for /health: its `ready` (enabled, capacity, block size, why
    disabled, whether the self-check turned it off) and the figures its latest reply carried
    (zeros before the first); None when the worker keeps no prefix cache at all."""
    info = lane.info.prefix_cache if lane.info is not None else None
    if info is None:
        return None
    stats = lane.prefix_stats
    return {
        "enabled": info.enabled,
        "capacity_bytes": info.capacity_bytes,
        "block_tokens": info.block_tokens,
        "disabled_reason": info.disabled_reason,
        "turned_off": info.turned_off,
        "bytes": stats.bytes if stats else 0,
        "entries": stats.entries if stats else 0,
        "hits": stats.hits if stats else 0,
        "lookups": stats.lookups if stats else 0,
        "tokens_reused": stats.tokens_reused if stats else 0,
    }


class WorkerPool:
    """The supervisors of all workers, and what admission and /health ask of them together."""

    def __init__(
        self,
        config: WorkerSettings,
        *,
        on_all_lost: Callable[[], None],
        on_ready: Callable[[], None],
        on_worker_failed: Callable[[str], None] | None = None,
        on_gave_up: Callable[[str], None] | None = None,
        on_suspect: Callable[[Supervisor, bool], None] | None = None,
    ) -> None:
        self._on_all_lost = on_all_lost
        self.lanes: Sequence[Supervisor] = [
            Supervisor(config, self._worker_lost, slot=slot, on_ready=on_ready,
                       on_worker_failed=on_worker_failed, on_gave_up=on_gave_up,
                       on_suspect=on_suspect)
            for slot in plan_slots(config)
        ]
        self._reloading = asyncio.Lock()

    async def start(self) -> None:
        """Start every worker at once; raise StartupFailed (all stopped) if any fails."""
        results = await asyncio.gather(*(lane.start() for lane in self.lanes),
                                       return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            for failure in failures:
                if not isinstance(failure, StartupFailed):
                    raise failure
            reasons = "; ".join(f"worker {lane.slot.name}: {r}" for lane, r in
                                zip(self.lanes, results, strict=True)
                                if isinstance(r, BaseException))
            raise StartupFailed(reasons if len(self.lanes) > 1 else str(failures[0]))

    def unavailable_reason(self) -> str | None:
        """None while at least one worker is ready, else the 503 detail."""
        reasons = [lane.unavailable_reason() for lane in self.lanes]
        if None in reasons:
            return None
        if "worker is restarting" in reasons:
            return "worker is restarting"
        return reasons[0]

    def state(self) -> WorkerState:
        """READY if any worker is; else RESTARTING if any is; else the first one's state."""
        states = [lane.state for lane in self.lanes]
        if self.unavailable_reason() is None:
            return WorkerState.READY
        if WorkerState.RESTARTING in states or WorkerState.READY in states:
            return WorkerState.RESTARTING
        return states[0]

    @property
    def restarts(self) -> int:
        return sum(lane.restarts for lane in self.lanes)

    def ready_lanes(self) -> list[Supervisor]:
        return [lane for lane in self.lanes if lane.unavailable_reason() is None]

    def serving(self, model: str) -> bool:
        """Whether some ready worker serves `model` ("": the base)."""
        return any(lane.serves(model) for lane in self.ready_lanes())

    def knows(self, model: str) -> bool:
        """Whether some worker, ready or restarting, served the variant `model` at its last
        `ready` (the catalogue still lists it: 503 rather than 404 while none is ready)."""
        return any(model in lane.variants for lane in self.lanes)

    def serves_weights(self, model: str, weights: str) -> bool:
        """Whether some ready worker serves `model` with the fingerprint `weights`: what an
        answer kept for repeats must still be, to be served."""
        return any(lane.weights_of(model) == weights for lane in self.ready_lanes())

    def variant_names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The variants some ready worker serves, and those any worker served at its last
        `ready` (ready or not now), each in the order the workers list them."""
        ready: dict[str, None] = {}
        known: dict[str, None] = {}
        for lane in self.lanes:
            known.update(dict.fromkeys(lane.variants))
            if lane.unavailable_reason() is None:
                ready.update(dict.fromkeys(lane.variants))
        return tuple(ready), tuple(known)

    def ready_info(self) -> ReadyInfo | None:
        """The first ready worker's ready frame (the single-worker view of /health, metrics)."""
        ready = self.ready_lanes()
        return ready[0].info if ready else None

    def suspect_lanes(self) -> list[Supervisor]:
        """Ready workers that are suspect (liveness.py): they get no new work."""
        return [lane for lane in self.ready_lanes() if lane.suspect is not None]

    def waiting_on_suspects(self) -> str | None:
        """Why nothing new is sent, when every ready worker is suspect (else None): their
        requests wait for their answer or their replacement (/health's `waiting_for`)."""
        ready = self.ready_lanes()
        suspects = [lane for lane in ready if lane.suspect is not None]
        if not suspects or len(suspects) < len(ready):
            return None
        parts = []
        for lane in suspects:
            judgement = lane.suspect
            assert judgement is not None
            parts.append(f"worker {lane.slot.name} is suspect ({judgement.reason}); its "
                         f"{lane.in_flight} request(s) wait for its answer or its replacement "
                         f"(killed after {judgement.kill_after:g}s of silence)")
        return "; ".join(parts)

    def describe(self) -> list[dict[str, Any]]:
        """One entry per worker for /health; `suspect` is null or why (liveness.py)."""
        out = []
        for lane in self.lanes:
            ready = lane.unavailable_reason() is None
            state = lane.state
            judgement = lane.suspect if ready else None
            out.append({
                "name": lane.slot.name,
                "device": lane.slot.device,
                "status": "ready" if ready else ("restarting" if state is WorkerState.READY
                                                 else str(state)),
                "pid": lane.info.pid if ready and lane.info else None,
                "in_flight": lane.in_flight,
                "max_batch": lane.max_batch,
                "restarts": lane.restarts,
                # The weights it serves, by model (the base under its served name): each
                # response names its own in `Clef-Weights`.
                "models": dict(lane.info.models) if ready and lane.info else {},
                "prefix_cache": prefix_cache_of(lane) if ready else None,
                # Where its start-up's seconds went (`ready.startup`: ready_s and phases).
                "startup": (asdict(lane.info.startup) if ready and lane.info
                            and lane.info.startup else None),
                "suspect": None if judgement is None else {
                    "reason": judgement.reason,
                    "for_s": round(lane.suspect_for, 3),
                    "silent_s": round(judgement.silent, 3),
                    "allowed_s": round(judgement.allowed, 3),
                    "kill_after_s": round(judgement.kill_after, 3),
                },
            })
        return out

    async def watch(self) -> None:
        """Supervise every worker until cancelled."""
        await asyncio.gather(*(lane.watch() for lane in self.lanes))

    async def reload(self) -> None:
        """Roll every worker onto the snapshot now at --model, one at a time (no downtime).

        One reload at a time: a second SIGHUP during a roll waits for it, then rolls again.
        """
        async with self._reloading:
            log.info("reload: rolling %d worker(s) one at a time", len(self.lanes))
            done = [await lane.reload() for lane in self.lanes]
            log.info("reload finished: %d of %d worker(s) replaced", sum(done), len(done))

    async def stop(self, grace: float | None = None) -> None:
        await asyncio.gather(*(lane.stop(grace) for lane in self.lanes))

    def _worker_lost(self) -> None:
        if self.unavailable_reason() is not None:
            self._on_all_lost()

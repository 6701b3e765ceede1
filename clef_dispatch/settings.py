"""The worker flags both drivers take (`clef-serve`, `clef-batch`): one argument group, one
validated value.

Where each worker runs (`--devices`, `--workers`, `--workers-per-device`), how it is started
(`--worker-command`, `--startup-timeout`), fed (`--max-batch`), judged (`--request-timeout`,
`--stall-timeout`), replaced (`--restart-backoff*`, and for clef-batch `--max-restarts`) and
stopped (`--shutdown-grace`). One definition, so both commands share the help text, the
defaults and the checks; `WorkerSettings.__post_init__` is the only place a value is refused.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

from clef_protocol.arg_types import (
    non_negative_float,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from clef_protocol.options import parse_device, worker_argv


@dataclass(frozen=True)
class WorkerSettings:
    """How the workers are placed, started, fed, judged, replaced and stopped.

    `devices` empty: `workers_per_device` workers with `worker_argv` as given; else one per
    entry, each times `workers_per_device`. How many requests each worker holds at once is
    not here: the worker resolves its batch policy once (`--max-batch`, a model flag it
    receives) and reports it in `ready` (ReadyInfo.requests_per_forward).
    `max_restarts` None: replace failed workers forever (the server); a number: after that
    many replacements the pool gives up (clef-batch, whose rerun resumes).
    """

    worker_argv: tuple[str, ...]
    devices: tuple[str, ...] = ()
    workers_per_device: int = 1
    startup_timeout: float = 900.0
    request_timeout: float = 300.0
    # A worker silent this long (no pong, no reply) while the front waits on it is wedged.
    stall_timeout: float = 30.0
    shutdown_grace: float = 10.0
    restart_backoff: float = 0.5
    restart_backoff_max: float = 30.0
    restart_reset_after: float = 60.0
    max_restarts: int | None = None

    @property
    def worker_count(self) -> int:
        """How many worker slots these settings plan (worker_pool.plan_slots)."""
        return max(1, len(self.devices)) * self.workers_per_device

    def __post_init__(self) -> None:
        if not self.worker_argv:
            raise ValueError("the worker command is empty")
        if self.workers_per_device < 1:
            raise ValueError("workers-per-device must be at least 1")
        for name in ("startup_timeout", "request_timeout", "stall_timeout", "shutdown_grace",
                     "restart_backoff_max", "restart_reset_after"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.restart_backoff < 0:
            raise ValueError("--restart-backoff must be >= 0")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError("--max-restarts must be >= 0")


DEFAULTS = WorkerSettings(worker_argv=("clef_worker",))


def _devices(value: str) -> tuple[str, ...]:
    """argparse type of --devices: cpu or cuda:N entries (a worker each), none twice."""
    items: list[str] = []
    for item in value.split(","):
        try:
            device = parse_device(item.strip())
        except ValueError:
            device = None
        if device is None or not (device.kind == "cpu" or device.index is not None):
            raise argparse.ArgumentTypeError(
                f"invalid device {item.strip()!r} in --devices: expected cpu or cuda:N")
        items.append(str(device))
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"a device is listed twice in --devices {value!r}")
    return tuple(items)


def add_worker_arguments(parser: argparse.ArgumentParser, *,
                         max_restarts: int | None = None) -> None:
    """The worker flags; `max_restarts` adds `--max-restarts` with that default (clef-batch:
    a run gives up, a server never does)."""
    d = DEFAULTS
    worker = parser.add_argument_group("workers")
    worker.add_argument("--worker-command", default=None,
                        help="command replacing 'python -m clef_worker' (shell-split); the model "
                             "flags are appended")
    worker.add_argument("--devices", type=_devices, default=None,
                        help="one worker per device, e.g. cuda:0,cuda:1 (each pinned with "
                             "CUDA_VISIBLE_DEVICES); overrides --device")
    worker.add_argument("--workers", type=positive_int, default=None,
                        help="N workers: on cuda:0..N-1 when --device is cuda, else N on "
                             "--device (ignored with --devices)")
    worker.add_argument("--workers-per-device", type=positive_int, default=d.workers_per_device,
                        help="workers per device (two keep serving while one restarts)")
    worker.add_argument("--startup-timeout", type=positive_seconds, default=d.startup_timeout,
                        help="seconds a worker may take to load and warm up")
    worker.add_argument("--request-timeout", type=positive_seconds, default=d.request_timeout,
                        help="seconds the worker may take to answer one request; past it the "
                             "worker counts as hung: it is killed and replaced, and the request "
                             "gets 500")
    worker.add_argument("--stall-timeout", type=positive_seconds, default=d.stall_timeout,
                        help="seconds a worker may stay silent (no pong, no reply) while the "
                             "front waits on it; past it the worker counts as stalled: its stack "
                             "is logged, it is killed and replaced, and its requests are sent "
                             "again")
    worker.add_argument("--shutdown-grace", type=positive_seconds, default=d.shutdown_grace,
                        help="seconds a worker may take to exit after 'shutdown' before SIGKILL")
    worker.add_argument("--restart-backoff", type=non_negative_float, default=d.restart_backoff,
                        help="delay before the first restart; doubles per consecutive failure")
    worker.add_argument("--restart-backoff-max", type=positive_seconds,
                        default=d.restart_backoff_max, help="cap on the restart delay")
    worker.add_argument("--restart-reset-after", type=positive_seconds,
                        default=d.restart_reset_after,
                        help="a worker up this long resets the backoff")
    if max_restarts is not None:
        worker.add_argument("--max-restarts", type=non_negative_int, default=max_restarts,
                            help="worker replacements before the run gives up (a rerun "
                                 "resumes)")


def workers_from(args: argparse.Namespace) -> tuple[tuple[str, ...], int]:
    """(devices, workers per device): --devices as given; --workers N with --device cuda is
    cuda:0..N-1; otherwise N unpinned workers on --device (devices empty)."""
    per_device = args.workers_per_device
    if args.devices:
        return tuple(args.devices), per_device
    if args.workers is not None and args.device == "cuda":
        return tuple(f"cuda:{i}" for i in range(args.workers)), per_device
    return (), per_device * (args.workers or 1)


def worker_command(args: argparse.Namespace) -> tuple[str, ...]:
    """The worker's command line: `--worker-command` (or `python -m clef_worker`), then the
    model flags (and, with `--finetune`, the served names); ValueError for an empty command."""
    command = (shlex.split(args.worker_command) if args.worker_command is not None
               else [sys.executable, "-m", "clef_worker"])
    if not command:
        raise ValueError("--worker-command is empty")
    served = getattr(args, "served_model_name", None)
    if args.finetune and served:
        # With variants the worker scores the base only under the names it was given as the
        # base's (clef_worker.loading.base_names), so it must know the served names.
        return (*command, *worker_argv(args), "--served-model-name", *served)
    return (*command, *worker_argv(args))


def worker_settings_from(args: argparse.Namespace) -> WorkerSettings:
    """The settings for parsed flags (model flags included); ValueError names the bad flag."""
    devices, per_device = workers_from(args)
    return WorkerSettings(
        worker_argv=worker_command(args),
        devices=devices,
        workers_per_device=per_device,
        startup_timeout=args.startup_timeout,
        request_timeout=args.request_timeout,
        stall_timeout=args.stall_timeout,
        shutdown_grace=args.shutdown_grace,
        restart_backoff=args.restart_backoff,
        restart_backoff_max=args.restart_backoff_max,
        restart_reset_after=args.restart_reset_after,
        max_restarts=getattr(args, "max_restarts", None),
    )

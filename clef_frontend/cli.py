"""`clef-serve` / `python -m clef_frontend`: flags -> ServerConfig -> run.

Model and request-limit flags come from `clef_protocol.options`, the single definition shared
with the worker, and are handed to the worker command unchanged by `worker_argv`; this module
adds only what the front itself uses (address, HTTP limits and timeouts, queue, supervision).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from clef_frontend import auth, logs, otel, priority
from clef_frontend.catalogue import served_name
from clef_frontend.config import ServerConfig
from clef_frontend.server import serve
from clef_frontend.supervisor import DEFAULT_MAX_BATCH_CPU, DEFAULT_MAX_BATCH_CUDA
from clef_frontend.version import version
from clef_protocol.options import (
    add_model_arguments,
    limits_from,
    parse_device,
    positive_int,
    worker_argv,
)

DEFAULTS = ServerConfig(worker_argv=("clef_worker",))


def _port(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{number} is not a TCP port (0 picks a free one)")
    return number


def _non_negative(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0 of `unit`."""

    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {unit}, got {value!r}") from None
        if not number >= 0 or number == float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite number of {unit}, got {value!r}")
        return number

    return parse


_seconds = _non_negative("seconds")


def _count(value: str) -> int:
    """An argparse type: a whole number >= 0."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}")
    return number
_rate = _non_negative("bytes per second")


def _objective_class(value: str) -> tuple[str, str]:
    try:
        return priority.parse_objective_class(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def workers_from(args: argparse.Namespace) -> tuple[tuple[str, ...], int]:
    """(devices, workers per device): --devices as given; --workers N with --device cuda is
    cuda:0..N-1; otherwise N unpinned workers on --device (devices empty)."""
    per_device = args.workers_per_device
    if args.devices:
        return tuple(args.devices), per_device
    if args.workers is not None and args.device == "cuda":
        return tuple(f"cuda:{i}" for i in range(args.workers)), per_device
    return (), per_device * (args.workers or 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-serve",
        description="Serve Clef over HTTP: an h11 front and persistent model workers, one or "
                    "more per device, each batching the requests it holds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"clef-serve {version()}")
    add_model_arguments(parser)
    d = DEFAULTS
    net = parser.add_argument_group("listening")
    net.add_argument("--host", default=d.host, help="address to bind")
    net.add_argument("--port", type=_port, default=d.port, help="TCP port; 0 picks a free one")
    net.add_argument("--backlog", type=positive_int, default=d.backlog,
                     help="listen queue of not yet accepted connections (the kernel caps it at "
                          "net.core.somaxconn)")
    net.add_argument("--metrics-port", type=_port, default=None,
                     help="serve GET /metrics on this port (same --host) instead of the public "
                          "one; 0 picks a free one")
    http = parser.add_argument_group("HTTP limits")
    http.add_argument("--body-limit", type=positive_int, default=d.body_limit,
                      help="largest accepted request body in bytes (413 above)")
    http.add_argument("--header-limit", type=positive_int, default=d.header_limit,
                      help="largest request head in bytes (431 above)")
    http.add_argument("--header-timeout", type=_seconds, default=d.header_timeout,
                      help="seconds for a whole request head once it has begun")
    http.add_argument("--body-timeout", type=_seconds, default=d.body_timeout,
                      help="seconds without a body byte before 408")
    http.add_argument("--body-min-rate", type=_rate, default=d.body_min_rate,
                      help="bytes/s a body must average once the grace period is over (408 "
                           "below); 0 turns the rate check off")
    http.add_argument("--body-rate-grace", type=_seconds, default=d.body_rate_grace,
                      help="seconds after the head before --body-min-rate applies")
    http.add_argument("--keepalive-timeout", type=_seconds, default=d.keepalive_timeout,
                      help="seconds an idle connection is kept open")
    http.add_argument("--send-timeout", type=_seconds, default=d.send_timeout,
                      help="seconds a client may take to accept a whole response (a deadline, "
                           "not inactivity); a slower reader is reset")
    queue = parser.add_argument_group("admission")
    queue.add_argument("--queue-size", type=positive_int, default=d.queue_size,
                       help="requests that may wait for the worker (503 when full)")
    queue.add_argument("--retry-after", type=int, default=d.retry_after,
                       help="Retry-After seconds on 503 answers")
    queue.add_argument("--max-batch", type=positive_int, default=None,
                       help="requests in flight to one worker, which batches them into one "
                            f"forward (default: {DEFAULT_MAX_BATCH_CUDA} on a CUDA worker, "
                            f"{DEFAULT_MAX_BATCH_CPU} on CPU)")
    queue.add_argument("--queue-timeout", type=_seconds, default=None,
                       help="seconds a request may wait for a worker before 504 (default: no "
                            "limit; X-Clef-Deadline-Ms sets one per request)")
    queue.add_argument("--answer-cache", type=_count, default=d.answer_cache,
                       metavar="ENTRIES",
                       help="answers kept for identical repeats of a key's requests, and "
                            "identical requests in flight share one forward; 0 turns both off")
    queue.add_argument("--objective-class", type=_objective_class, action="append", default=[],
                       metavar="NAME=CLASS",
                       help="behind the inference gateway: requests whose "
                            "x-llm-d-inference-objective is NAME wait as CLASS (interactive or "
                            "bulk) unless X-Clef-Priority says otherwise; repeat per objective "
                            "(default: objectives are ignored)")
    queue.add_argument("--drain-timeout", type=_seconds, default=d.drain_timeout,
                       help="seconds to finish queued work after SIGTERM before answering 503")
    worker = parser.add_argument_group("worker supervision")
    worker.add_argument("--worker-command", default=None,
                        help="command replacing 'python -m clef_worker' (shell-split); the model "
                             "flags are appended")
    worker.add_argument("--devices", type=_devices, default=None,
                        help="one worker per device, e.g. cuda:0,cuda:1 (each pinned with "
                             "CUDA_VISIBLE_DEVICES); overrides --device")
    worker.add_argument("--workers", type=positive_int, default=None,
                        help="N workers: on cuda:0..N-1 when --device is cuda, else N on "
                             "--device (ignored with --devices)")
    worker.add_argument("--workers-per-device", type=positive_int, default=1,
                        help="workers per device (two keep serving while one restarts)")
    worker.add_argument("--startup-timeout", type=_seconds, default=d.startup_timeout,
                        help="seconds a worker may take to load and warm up")
    worker.add_argument("--request-timeout", type=_seconds, default=d.request_timeout,
                        help="seconds the worker may take to answer one request; past it the "
                             "worker counts as hung: it is killed and replaced, and the request "
                             "gets 500")
    worker.add_argument("--stall-timeout", type=_seconds, default=d.stall_timeout,
                        help="seconds a worker may stay silent (no pong, no reply) while the "
                             "front waits on it; past it the worker counts as stalled: it is "
                             "killed and replaced, and its requests are sent again")
    worker.add_argument("--shutdown-grace", type=_seconds, default=d.shutdown_grace,
                        help="seconds a worker may take to exit after 'shutdown' before SIGKILL")
    worker.add_argument("--restart-backoff", type=_seconds, default=d.restart_backoff,
                        help="delay before the first restart; doubles per consecutive failure")
    worker.add_argument("--restart-backoff-max", type=_seconds, default=d.restart_backoff_max,
                        help="cap on the restart delay")
    worker.add_argument("--restart-reset-after", type=_seconds, default=d.restart_reset_after,
                        help="a worker up this long resets the backoff")
    api = parser.add_argument_group("clients")
    api.add_argument("--served-model-name", nargs="+", type=served_name, default=None,
                     metavar="NAME",
                     help="the model's name in /v1/models and Workers-AI paths, then aliases "
                          "(default: the --variant)")
    api.add_argument("--api-key-file", default=None, metavar="PATH",
                     help=f"require 'Authorization: Bearer <key>': keys one per line in PATH, "
                          f"or named keys with quotas in a PATH ending in .toml; re-read when "
                          f"the file changes; also ${auth.ENV_VAR}. Never put a key on the "
                          f"command line")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def config_from(args: argparse.Namespace) -> ServerConfig:
    """Build the config; ValueError names the flag that is wrong."""
    if args.worker_command is None:
        command = [sys.executable, "-m", "clef_worker"]
    else:
        command = shlex.split(args.worker_command)
        if not command:
            raise ValueError("--worker-command is empty")
    devices, per_device = workers_from(args)
    return ServerConfig(
        worker_argv=(*command, *worker_argv(args)),
        limits=limits_from(args),
        host=args.host,
        port=args.port,
        backlog=args.backlog,
        metrics_port=args.metrics_port,
        body_limit=args.body_limit,
        header_limit=args.header_limit,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        body_min_rate=args.body_min_rate,
        body_rate_grace=args.body_rate_grace,
        keepalive_timeout=args.keepalive_timeout,
        send_timeout=args.send_timeout,
        queue_size=args.queue_size,
        retry_after=args.retry_after,
        drain_timeout=args.drain_timeout,
        startup_timeout=args.startup_timeout,
        request_timeout=args.request_timeout,
        shutdown_grace=args.shutdown_grace,
        restart_backoff=args.restart_backoff,
        restart_backoff_max=args.restart_backoff_max,
        restart_reset_after=args.restart_reset_after,
        served_model_names=tuple(args.served_model_name or (args.variant,)),
        api_key_file=args.api_key_file,
        api_key=os.environ.get(auth.ENV_VAR) or None,
        devices=devices,
        workers_per_device=per_device,
        max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens,
        stall_timeout=args.stall_timeout,
        queue_timeout=args.queue_timeout or None,
        answer_cache=args.answer_cache,
        objective_classes=tuple(args.objective_class),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from(args)
        if config.api_key_file is not None:
            auth.load_key_file(Path(config.api_key_file))  # refuse an unusable file up front
    except ValueError as exc:
        parser.error(str(exc))
    logs.configure(args.log_level, args.log_format)
    try:
        otel.start()
    except otel.TracingConfigError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(serve(config))
    finally:
        otel.stop()  # the last spans leave before the process does

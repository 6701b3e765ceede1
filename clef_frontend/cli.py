"""`clef-serve` / `python -m clef_frontend`: flags -> ServerConfig -> run.

Model and request-limit flags come from `clef_protocol.options`, the single definition shared
with the worker, and are handed to the worker command unchanged by `worker_argv`; this module
adds only what the front itself uses (address, HTTP limits and timeouts, queue, supervision).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from clef_api.catalogue import served_name
from clef_dispatch import WorkerSettings, add_worker_arguments, worker_settings_from
from clef_frontend import auth, logs, otel, priority
from clef_frontend.config import ServerConfig
from clef_frontend.server import serve
from clef_frontend.version import describe
from clef_protocol.arg_types import (
    bytes_per_second,
    non_negative_int,
    non_negative_seconds,
    port,
    positive_int,
)
from clef_protocol.finetune import resolve_finetunes
from clef_protocol.options import add_model_arguments, limits_from

# The subcommand that builds the kernel cache ahead of time (`warm_cache`).
WARM_CACHE = "warm-cache"
DEFAULTS = ServerConfig(WorkerSettings(worker_argv=("clef_worker",)))


def _objective_class(value: str) -> tuple[str, str]:
    try:
        return priority.parse_objective_class(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Version(argparse.Action):
    """`--version`, worked out only when asked (in a checkout it runs git: no start-up cost)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        print(describe())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clef-serve",
        description="Serve Clef over HTTP: an h11 front and persistent model workers, one or "
                    "more per device, each batching the requests it holds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"`clef-serve {WARM_CACHE} MODEL-FLAGS...` starts one worker with those model "
               "flags, fills the kernel cache and keeps the self-check's verdict, then exits "
               "(0: it would have been ready): build the cache ahead of time.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version and the commit it was built from, then exit")
    add_model_arguments(parser)
    d = DEFAULTS
    net = parser.add_argument_group("listening")
    net.add_argument("--host", default=d.host, help="address to bind")
    net.add_argument("--port", type=port, default=d.port, help="TCP port; 0 picks a free one")
    net.add_argument("--backlog", type=positive_int, default=d.backlog,
                     help="listen queue of not yet accepted connections (the kernel caps it at "
                          "net.core.somaxconn)")
    net.add_argument("--metrics-port", type=port, default=None,
                     help="serve GET /metrics on this port (same --host) instead of the public "
                          "one; 0 picks a free one")
    http = parser.add_argument_group("HTTP limits")
    http.add_argument("--body-limit", type=positive_int, default=d.body_limit,
                      help="largest accepted request body in bytes (413 above)")
    http.add_argument("--header-limit", type=positive_int, default=d.header_limit,
                      help="largest request head in bytes (431 above)")
    http.add_argument("--header-timeout", type=non_negative_seconds, default=d.header_timeout,
                      help="seconds for a whole request head once it has begun")
    http.add_argument("--body-timeout", type=non_negative_seconds, default=d.body_timeout,
                      help="seconds without a body byte before 408")
    http.add_argument("--body-min-rate", type=bytes_per_second, default=d.body_min_rate,
                      help="bytes/s a body must average once the grace period is over (408 "
                           "below); 0 turns the rate check off")
    http.add_argument("--body-rate-grace", type=non_negative_seconds, default=d.body_rate_grace,
                      help="seconds after the head before --body-min-rate applies")
    http.add_argument("--keepalive-timeout", type=non_negative_seconds, default=d.keepalive_timeout,
                      help="seconds an idle connection is kept open")
    http.add_argument("--send-timeout", type=non_negative_seconds, default=d.send_timeout,
                      help="seconds a client may take to accept a whole response (a deadline, "
                           "not inactivity); a slower reader is reset")
    queue = parser.add_argument_group("admission")
    queue.add_argument("--queue-size", type=positive_int, default=d.queue_size,
                       help="requests that may wait for the worker (503 when full)")
    queue.add_argument("--retry-after", type=int, default=d.retry_after,
                       help="Retry-After seconds on 503 answers")
    queue.add_argument("--queue-timeout", type=non_negative_seconds, default=None,
                       help="seconds a request may wait for a worker before 504 (default: no "
                            "limit; X-Clef-Deadline-Ms sets one per request)")
    queue.add_argument("--answer-cache", type=non_negative_int, default=d.answer_cache,
                       metavar="ENTRIES",
                       help="answers kept for identical repeats of a key's requests, and "
                            "identical requests in flight share one forward; 0 turns both off")
    queue.add_argument("--answer-cache-bytes", type=positive_int, default=d.answer_cache_bytes,
                       metavar="BYTES",
                       help="the most the kept answers may hold together (their bodies and "
                            f"keys; default {d.answer_cache_bytes // 2**20} MiB): the least "
                            "recently used go first")
    queue.add_argument("--objective-class", type=_objective_class, action="append", default=[],
                       metavar="NAME=CLASS",
                       help="behind the inference gateway: requests whose "
                            "x-llm-d-inference-objective is NAME wait as CLASS (interactive or "
                            "bulk) unless X-Clef-Priority says otherwise; repeat per objective "
                            "(default: objectives are ignored)")
    queue.add_argument("--drain-timeout", type=non_negative_seconds, default=d.drain_timeout,
                       help="seconds to finish queued work after SIGTERM before answering 503")
    add_worker_arguments(parser)
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
    served = tuple(args.served_model_name or (args.variant,))
    return ServerConfig(
        workers=worker_settings_from(args),
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
        served_model_names=served,
        finetune_names=tuple(f.name for f in resolve_finetunes(args.finetune,
                                                              (*served, args.variant))),
        finetune_given=bool(args.finetune),
        api_key_file=args.api_key_file,
        api_key=os.environ.get(auth.ENV_VAR) or None,
        queue_timeout=args.queue_timeout or None,
        answer_cache=args.answer_cache,
        answer_cache_bytes=args.answer_cache_bytes,
        objective_classes=tuple(args.objective_class),
    )


def warm_cache(model_args: list[str]) -> int:
    """`clef-serve warm-cache MODEL-FLAGS...`: the worker's `--warm-only` start in this
    process's place (the front never imports torch): it fills the kernel cache and keeps the
    self-check's verdict for those flags, then exits 0, or 1 when the worker could not start.
    For an init container or a build step (docs/operations.md, Start-up time)."""
    command = [sys.executable, "-m", "clef_worker", "--warm-only", *model_args]
    os.execv(command[0], command)
    return 1  # not reached: execv replaces the process or raises


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == [WARM_CACHE]:
        return warm_cache(arguments[1:])
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

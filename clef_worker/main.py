"""The worker process: claim the channel, load, warm up, report `ready`, then serve forever.

Everything runs on the main thread, the thread that initialised CUDA: the whole point of the
worker is that the per-thread CUDA first-touch cost is paid once, at start-up, not per request.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from typing import BinaryIO

from clef_protocol import messages
from clef_protocol.body import BadRequestBody
from clef_protocol.frames import FrameError, read_frame_blocking, write_frame_blocking
from clef_protocol.options import add_model_arguments
from clef_protocol.validation import RequestInvalid
from clef_worker.executor import Executor, ExecutorBroken, StartupError
from clef_worker.logs import configure as configure_logs
from clef_worker.logs import request_context

log = logging.getLogger("clef_worker")

INFERENCE_FAILED = "inference failed"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m clef_worker",
        description="clef-serve worker: speaks length-prefixed msgpack frames on stdin/stdout.",
    )
    add_model_arguments(parser)
    return parser.parse_args(argv)


def _elapsed_ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


def handle_request(executor: Executor, request_id: int, body: object) -> tuple[dict, bool]:
    """Answer one request: (reply frame, whether the executor is broken and the worker must
    exit). Every outcome is a reply frame, never an exception."""
    start = time.perf_counter()
    if not isinstance(body, bytes):
        reply = messages.error(request_id, 400, "request frame has no body", _elapsed_ms(start))
        return reply, False
    try:
        answer = executor.answer(body)
    except RequestInvalid as exc:
        return messages.error(request_id, 422, str(exc), _elapsed_ms(start)), False
    except BadRequestBody as exc:
        return messages.error(request_id, 400, str(exc), _elapsed_ms(start)), False
    except Exception as exc:
        # The cause goes to the log, never to the client (http-contract row 13).
        log.error("request %s failed:\n%s", request_id, traceback.format_exc())
        broken = isinstance(exc, ExecutorBroken)
        return messages.error(request_id, 500, INFERENCE_FAILED, _elapsed_ms(start)), broken
    reply = messages.response(request_id, answer.body, _elapsed_ms(start),
                              input_tokens=answer.input_tokens,
                              truncated_tokens=answer.truncated_tokens)
    return reply, False


def serve(executor: Executor, channel_in: BinaryIO, channel_out: BinaryIO) -> int:
    """Read request frames until EOF or `shutdown`; one reply frame per request."""
    while True:
        try:
            message = read_frame_blocking(channel_in)
        except FrameError as exc:
            log.error("unreadable frame from the front, exiting: %s", exc)
            return messages.EXIT_PROTOCOL_ERROR
        if message is None or message["kind"] == messages.SHUTDOWN:
            log.info("shutting down")
            return 0
        request_id = message.get("id")
        if message["kind"] != messages.REQUEST or not isinstance(request_id, int):
            log.error("unexpected %r frame from the front, exiting", message["kind"])
            return messages.EXIT_PROTOCOL_ERROR
        with request_context(message.get("trace_id")):
            reply, broken = handle_request(executor, request_id, message.get("body"))
            write_frame_blocking(channel_out, reply)
            if broken:
                log.error("the executor cannot go on; exiting so the front starts a fresh worker")
                return messages.EXIT_EXECUTOR_BROKEN


def start(args: argparse.Namespace, channel_out: BinaryIO) -> Executor | None:
    """Load and warm up; send `ready`, or `fatal` with a reason the operator can act on."""
    from clef_worker.loading import load_executor

    try:
        executor = load_executor(args)
        started = time.perf_counter()
        executor.warm_up()
        warmup_ms = _elapsed_ms(started)
    except StartupError as exc:
        reason = str(exc)
    except Exception as exc:
        log.error("start-up failed:\n%s", traceback.format_exc())
        reason = f"{type(exc).__name__}: {exc}"
    else:
        ready = messages.ReadyInfo(
            **dataclasses.asdict(executor.describe()),
            pid=os.getpid(), thread=threading.current_thread().name, warmup_ms=warmup_ms,
        )
        write_frame_blocking(channel_out, messages.ready(ready))
        return executor
    log.error("cannot start: %s", reason)
    write_frame_blocking(channel_out, messages.fatal(reason))
    return None


def main(argv: list[str] | None = None) -> int:
    from clef_worker.stdio import claim_channel

    channel_in, channel_out = claim_channel()
    # The front decides when the worker stops: after draining it sends `shutdown` (or closes
    # stdin), and it SIGKILLs a worker that does not exit. Ctrl-C on a terminal, or a service
    # manager signalling every process of the service, must not kill the request in flight.
    # The worker cannot outlive the front: the front's exit closes stdin, which ends the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logs()
    args = parse_args(argv)
    executor = start(args, channel_out)
    if executor is None:
        return 1
    return serve(executor, channel_in, channel_out)

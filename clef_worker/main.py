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
from typing import BinaryIO, cast

from clef_protocol import messages
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.frames import (
    FrameError,
    encode_frame,
    read_frame_blocking,
    write_frame_blocking,
    write_frames,
)
from clef_protocol.messages import INFERENCE_FAILED
from clef_protocol.options import add_model_arguments
from clef_worker.allocator import keep_freed_memory
from clef_worker.batching import (
    NO_BODY,
    BatchingExecutor,
    BatchPolicy,
    Outcome,
    answer_groups,
    collect_waiting,
    default_max_batch_tokens,
    supports_batching,
)
from clef_worker.errors import ExecutorBroken, StartupError
from clef_worker.executor import Answer, Executor
from clef_worker.logs import configure as configure_logs
from clef_worker.logs import request_context

log = logging.getLogger("clef_worker")


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
    try:
        if not isinstance(body, bytes):
            raise BadRequestBody(NO_BODY)
        outcome = Outcome(value=executor.answer(body))
    except Exception as exc:
        outcome = Outcome(error=exc)
    return reply_for(request_id, outcome, _elapsed_ms(start))


def reply_for(request_id: int, outcome: Outcome, worker_ms: float) -> tuple[dict, bool]:
    """The reply frame for one answered or failed request, and whether the executor broke."""
    exc = outcome.error
    if exc is None:
        answer: Answer = outcome.value
        reply = messages.response(request_id, answer.body, worker_ms,
                                  input_tokens=answer.input_tokens,
                                  truncated_tokens=answer.truncated_tokens,
                                  batch_size=outcome.batch_size)
        return reply, False
    if isinstance(exc, RequestInvalid):
        return messages.error(request_id, 422, str(exc), worker_ms), False
    if isinstance(exc, BadRequestBody):
        return messages.error(request_id, 400, str(exc), worker_ms), False
    # The cause goes to the log, never to the client (http-contract row 13).
    log.error("request %s failed:", request_id, exc_info=exc)
    broken = isinstance(exc, ExecutorBroken)
    return messages.error(request_id, 500, INFERENCE_FAILED, worker_ms), broken


def _stop_code(message: dict | None) -> int | None:
    """None for a request frame; else the exit status the frame calls for."""
    if message is None or message["kind"] == messages.SHUTDOWN:
        log.info("shutting down")
        return 0
    if message["kind"] != messages.REQUEST or not isinstance(message.get("id"), int):
        log.error("unexpected %r frame from the front, exiting", message["kind"])
        return messages.EXIT_PROTOCOL_ERROR
    return None


def serve(executor: Executor, channel_in: BinaryIO, channel_out: BinaryIO,
          policy: BatchPolicy | None = None) -> int:
    """Read request frames until EOF or `shutdown`; one reply frame per request, in order.

    With an executor that batches (clef_worker.batching), every request frame already waiting
    after the first (up to `policy.window_ms` more) is answered by shared forwards.
    """
    policy = policy or BatchPolicy()
    batching = supports_batching(executor)
    while True:
        try:
            message = read_frame_blocking(channel_in)
        except FrameError as exc:
            log.error("unreadable frame from the front, exiting: %s", exc)
            return messages.EXIT_PROTOCOL_ERROR
        stop = _stop_code(message)
        if stop is not None:
            return stop
        assert message is not None
        requests = [message]
        if batching:
            try:
                for extra in collect_waiting(channel_in, read_frame_blocking, policy.window_ms):
                    stop = _stop_code(extra)
                    if stop is not None:
                        break
                    assert extra is not None
                    requests.append(extra)
            except FrameError as exc:
                log.error("unreadable frame from the front, exiting after the batch: %s", exc)
                stop = messages.EXIT_PROTOCOL_ERROR
        if _answer_all(executor, requests, channel_out, policy, batching):
            log.error("the executor cannot go on; exiting so the front starts a fresh worker")
            return messages.EXIT_EXECUTOR_BROKEN
        if stop is not None:
            return stop


def _answer_all(executor: Executor, requests: list[dict], channel_out: BinaryIO,
                policy: BatchPolicy, batching: bool) -> bool:
    """Write one reply per request, in order; True when the executor broke (the requests
    not yet run then fail with 500 without touching the device)."""
    ids = [int(request["id"]) for request in requests]
    if not batching:
        for position, request_id in enumerate(ids):
            with request_context(requests[position].get("trace_id")):
                reply, broken = handle_request(executor, request_id,
                                               requests[position].get("body"))
                write_frame_blocking(channel_out, reply)
            if broken:
                _fail_rest(ids[position + 1:], channel_out)
                return True
        return False
    start = time.perf_counter()
    bodies = [request.get("body") for request in requests]
    for group in answer_groups(cast(BatchingExecutor, executor), bodies, policy):
        frames = []
        for position, outcome in group:
            with request_context(requests[position].get("trace_id")):
                reply, broken = reply_for(ids[position], outcome, _elapsed_ms(start))
            frames.append(encode_frame(reply))
            if broken:
                write_frames(channel_out, frames)
                _fail_rest(ids[position + 1:], channel_out)
                return True
        write_frames(channel_out, frames)  # a forward's replies leave together
    return False


def _fail_rest(ids: list[int], channel_out: BinaryIO) -> None:
    for request_id in ids:
        write_frame_blocking(channel_out, messages.error(request_id, 500, INFERENCE_FAILED, 0.0))


def batch_policy(args: argparse.Namespace, device: str) -> BatchPolicy:
    """The batching flags for a worker on `device`; `--max-batch-tokens 0` is its default."""
    return BatchPolicy(max_batch_tokens=args.max_batch_tokens or default_max_batch_tokens(device),
                       window_ms=args.batch_window_ms)


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
    configure_logs(log_format=args.log_format)
    keep_freed_memory()
    executor = start(args, channel_out)
    if executor is None:
        return 1
    return serve(executor, channel_in, channel_out, batch_policy(args, executor.describe().device))

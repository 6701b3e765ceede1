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
from dataclasses import dataclass
from typing import BinaryIO

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
from clef_protocol.options import add_model_arguments, default_max_batch_tokens
from clef_worker.allocator import keep_freed_memory
from clef_worker.batching import (
    BatchingExecutor,
    BatchPolicy,
    Outcome,
    answer_groups,
    as_batching,
    frame_waiting,
)
from clef_worker.errors import ExecutorBroken, StartupError
from clef_worker.executor import Executor
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


def handle_request(executor: Executor | BatchingExecutor, request_id: int,
                   body: object) -> tuple[dict, bool]:
    """Answer one request on the serve loop's path: (reply frame, whether the executor is
    broken and the worker must exit). Every outcome is a reply frame, never an exception."""
    start = time.perf_counter()
    [[(_, outcome)]] = list(answer_groups(as_batching(executor), [body], BatchPolicy()))
    return reply_for(request_id, outcome, _elapsed_ms(start))


def reply_for(request_id: int, outcome: Outcome, worker_ms: float) -> tuple[dict, bool]:
    """The reply frame for one answered or failed request, and whether the executor broke."""
    exc = outcome.error
    if exc is None:
        answer = outcome.value
        assert answer is not None
        reply = messages.response(request_id, answer.body, worker_ms,
                                  input_tokens=answer.input_tokens,
                                  truncated_tokens=answer.truncated_tokens,
                                  batch_size=answer.batch_size, stages=outcome.stages())
        return reply, False
    if isinstance(exc, RequestInvalid):
        return messages.error(request_id, 422, str(exc), worker_ms), False
    if isinstance(exc, BadRequestBody):
        return messages.error(request_id, 400, str(exc), worker_ms), False
    # The cause goes to the log, never to the client (http-contract row 13).
    log.error("request %s failed:", request_id, exc_info=exc)
    broken = isinstance(exc, ExecutorBroken)
    return messages.error(request_id, 500, INFERENCE_FAILED, worker_ms), broken


@dataclass
class Received:
    """A request frame and when it was read (its `worker_ms` counts from then)."""

    frame: dict
    read_at: float


class FrameReader:
    """Reads the front's frames: requests are queued for the next forwards, every `ping` is
    answered with `pong` at once (so a ping never waits behind, nor holds up, the requests being
    gathered), and `shutdown`, EOF or a bad frame set `stop`, the exit status to end with once
    the requests already read are answered."""

    def __init__(self, channel_in: BinaryIO, channel_out: BinaryIO):
        self.channel_in = channel_in
        self.channel_out = channel_out
        self.pending: list[Received] = []
        self.stop: int | None = None

    def next_requests(self, window_ms: float) -> list[Received]:
        """Block until a request (or a stop) arrives, then take every frame already waiting,
        waiting up to `window_ms` for more; returns the requests read, in order."""
        while not self.pending and self.stop is None:
            self._read_one()
        if self.stop is None:
            self._read_waiting(window_ms)
        requests, self.pending = self.pending, []
        return requests

    def poll(self) -> None:
        """Between forwards: answer the pings already waiting (requests are kept for later)."""
        if self.stop is None:
            self._read_waiting(0.0)

    def _read_waiting(self, window_ms: float) -> None:
        deadline = time.monotonic() + window_ms / 1000.0
        while self.stop is None and frame_waiting(self.channel_in, deadline - time.monotonic()):
            self._read_one()

    def _read_one(self) -> None:
        try:
            message = read_frame_blocking(self.channel_in)
        except FrameError as exc:
            log.error("unreadable frame from the front, exiting%s: %s",
                      " after the requests already read" if self.pending else "", exc)
            self.stop = messages.EXIT_PROTOCOL_ERROR
            return
        if message is None or message["kind"] == messages.SHUTDOWN:
            log.info("shutting down")
            self.stop = 0
        elif message["kind"] == messages.PING and _is_int(message.get("seq")):
            write_frame_blocking(self.channel_out, messages.pong(message["seq"]))
        elif message["kind"] == messages.REQUEST and _is_int(message.get("id")):
            self.pending.append(Received(message, time.perf_counter()))
        else:
            log.error("unexpected %r frame from the front, exiting", message["kind"])
            self.stop = messages.EXIT_PROTOCOL_ERROR


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def serve(executor: Executor | BatchingExecutor, channel_in: BinaryIO, channel_out: BinaryIO,
          policy: BatchPolicy | None = None) -> int:
    """Read frames until EOF or `shutdown`; one reply frame per request, in order.

    One path for every executor: an executor that does not batch is adapted (`OneAtATime`).
    Every request frame already waiting after the first (up to `policy.window_ms` more) is
    prepared together and answered by as few forwards as the token budget allows; pings are
    answered while gathering and between forwards.
    """
    policy = policy or BatchPolicy()
    batcher = as_batching(executor)
    reader = FrameReader(channel_in, channel_out)
    while True:
        requests = reader.next_requests(policy.window_ms)
        if requests and _answer_all(batcher, requests, reader, policy):
            log.error("the executor cannot go on; exiting so the front starts a fresh worker")
            return messages.EXIT_EXECUTOR_BROKEN
        if reader.stop is not None and not reader.pending:
            return reader.stop


def _answer_all(batcher: BatchingExecutor, requests: list[Received], reader: FrameReader,
                policy: BatchPolicy) -> bool:
    """Write one reply per request, in order; True when the executor broke (the requests
    not yet run then fail with 500 without touching the device)."""
    ids = [int(request.frame["id"]) for request in requests]
    bodies = [request.frame.get("body") for request in requests]
    channel_out = reader.channel_out
    for group in answer_groups(batcher, bodies, policy):
        frames = []
        for position, outcome in group:
            with request_context(requests[position].frame.get("trace_id")):
                reply, broken = reply_for(ids[position], outcome,
                                          _elapsed_ms(requests[position].read_at))
            frames.append(encode_frame(reply))
            if broken:
                write_frames(channel_out, frames)
                _fail_rest(ids[position + 1:], channel_out)
                _fail_rest([int(r.frame["id"]) for r in reader.pending], channel_out)
                reader.pending.clear()
                return True
        write_frames(channel_out, frames)  # a forward's replies leave together
        reader.poll()
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
            pings=True,  # `serve` answers every ping between forwards
        )
        log.info("ready in %.0f ms%s", warmup_ms, f" (kernel cache {ready.kernel_cache} at start)"
                 if ready.kernel_cache else "")
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

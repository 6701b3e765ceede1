"""The worker process: claim the channel, load, warm up, report `ready`, then serve forever.

Everything runs on the main thread, the thread that initialised CUDA: the whole point of the
worker is that the per-thread CUDA first-touch cost is paid once, at start-up, not per request.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO

from clef_protocol import messages
from clef_protocol.errors import BadRequestBody, ProtocolError, RequestInvalid, UnknownModel
from clef_protocol.frames import (
    encode_frame,
    read_frame_blocking,
    write_frame_blocking,
    write_frames,
)
from clef_protocol.messages import INFERENCE_FAILED
from clef_protocol.options import add_model_arguments
from clef_worker.allocator import keep_freed_memory
from clef_worker.errors import ExecutorBroken, StartupError
from clef_worker.logs import configure as configure_logs
from clef_worker.logs import enable_stack_dumps, request_context
from clef_worker.serving.batching import (
    BatchingExecutor,
    HostHelper,
    Outcome,
    answer_groups,
    as_batching,
    frame_waiting,
)
from clef_worker.serving.executor import Executor, LoadedExecutor
from clef_worker.serving.policy import BatchPolicy

log = logging.getLogger("clef_worker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m clef_worker",
        description="clef-serve worker: speaks length-prefixed msgpack frames on stdin/stdout.",
    )
    add_model_arguments(parser)
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="with --finetune: the names the base model answers to besides "
                             "--variant (the front passes its own); any other name that is not "
                             "a variant is refused (404 unknown model)")
    parser.add_argument("--warm-only", action="store_true",
                        help="start as a worker would (load, warm up: every kernel compiled and "
                             "autotuned into the kernel cache; the self-check, its verdict kept), "
                             "log the start-up's phases and exit: 0 when the worker would have "
                             "been ready, 1 otherwise. Needs no front: builds the kernel cache "
                             "ahead of time (a container build step, an init container)")
    return parser.parse_args(argv)


def _elapsed_ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


def reply_for(frame_id: int, outcome: Outcome, worker_ms: float,
              weights: Mapping[str, str] | None = None) -> tuple[dict, bool]:
    """The reply frame for one answered or failed request, and whether the executor broke.

    `weights` maps the model that scored an answer (`Answer.model`: "" for the base) to its
    fingerprint, which the response frame carries."""
    exc = outcome.error
    if exc is None:
        answer = outcome.value
        assert answer is not None
        reply = messages.response(frame_id, answer.body, worker_ms,
                                  input_tokens=answer.input_tokens,
                                  truncated_tokens=answer.truncated_tokens,
                                  batch_size=answer.batch_size, stages=outcome.stages(),
                                  prefix=answer.prefix,
                                  weights=(weights or {}).get(answer.model, ""))
        return reply, False
    if isinstance(exc, UnknownModel):
        return messages.error(frame_id, 404, str(exc), worker_ms), False
    if isinstance(exc, RequestInvalid):
        return messages.error(frame_id, 422, str(exc), worker_ms), False
    if isinstance(exc, BadRequestBody):
        return messages.error(frame_id, 400, str(exc), worker_ms), False
    # The cause goes to the log, never to the client (docs/http-contract.md row 13).
    log.error("frame %s failed:", frame_id, exc_info=exc)
    broken = isinstance(exc, ExecutorBroken)
    return messages.error(frame_id, 500, INFERENCE_FAILED, worker_ms), broken


@dataclass
class Received:
    """A request frame and when it was read (its `worker_ms` counts from then)."""

    frame: messages.Request
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
            frame = None if message is None else messages.from_front(message)
        except ProtocolError as exc:
            log.error("unreadable frame from the front, exiting%s: %s",
                      " after the requests already read" if self.pending else "", exc)
            self.stop = messages.EXIT_PROTOCOL_ERROR
            return
        if frame is None or isinstance(frame, messages.Shutdown):
            log.info("shutting down")
            self.stop = 0
        elif isinstance(frame, messages.Ping):
            write_frame_blocking(self.channel_out, messages.pong(frame.seq))
        else:
            self.pending.append(Received(frame, time.perf_counter()))


def serve(executor: Executor | BatchingExecutor, channel_in: BinaryIO, channel_out: BinaryIO,
          policy: BatchPolicy | None = None, *, weights: Mapping[str, str] | None = None) -> int:
    """Read frames until EOF or `shutdown`; one reply frame per request, in order.

    `policy` is the executor's (`executor.policy`, resolved once when it was loaded); tests'
    fake executors, which have none, get `BatchPolicy()`'s defaults.

    One path for every executor: an executor that does not batch is adapted (`OneAtATime`).
    Every request frame already waiting after the first (up to `policy.window_ms` more) is
    prepared together and answered by as few forwards as the token budget allows; pings are
    answered while gathering and between forwards. `weights` (`answer_weights`) gives each
    response the fingerprint of the model that scored it.
    """
    policy = policy or BatchPolicy()  # the loaded executor's own; the dataclass's for fakes
    batcher = as_batching(executor)
    reader = FrameReader(channel_in, channel_out)
    helper = HostHelper()
    try:
        while True:
            requests = reader.next_requests(policy.window_ms)
            if requests and _answer_all(batcher, requests, reader, policy, helper, weights):
                log.error("the executor cannot go on; exiting so the front starts a fresh "
                          "worker")
                return messages.EXIT_EXECUTOR_BROKEN
            if reader.stop is not None and not reader.pending:
                return reader.stop
    finally:
        helper.close()


def _answer_all(batcher: BatchingExecutor, requests: list[Received], reader: FrameReader,
                policy: BatchPolicy, helper: HostHelper | None = None,
                weights: Mapping[str, str] | None = None) -> bool:
    """Write one reply per request, in order; True when the executor broke (the requests
    not yet run then fail with 500 without touching the device)."""
    ids = [request.frame.id for request in requests]
    bodies: list[object] = [request.frame.body for request in requests]
    # Closed explicitly when a broken device ends the read early: the helper stops at once.
    with contextlib.closing(answer_groups(batcher, bodies, policy, helper)) as groups:
        return _write_groups(groups, requests, reader, ids, weights)


def _write_groups(groups: Iterator[list[tuple[int, Outcome]]], requests: list[Received],
                  reader: FrameReader, ids: list[int],
                  weights: Mapping[str, str] | None = None) -> bool:
    """Write each group's replies as it is answered; True when the executor broke."""
    channel_out = reader.channel_out
    for group in groups:
        frames = []
        for position, outcome in group:
            frame = requests[position].frame
            with request_context(frame.request_id, frame.trace_id):
                reply, broken = reply_for(ids[position], outcome,
                                          _elapsed_ms(requests[position].read_at), weights)
            frames.append(encode_frame(reply))
            if broken:
                write_frames(channel_out, frames)
                _fail_rest(ids[position + 1:], channel_out)
                _fail_rest([r.frame.id for r in reader.pending], channel_out)
                reader.pending.clear()
                return True
        write_frames(channel_out, frames)  # a forward's replies leave together
        reader.poll()
    return False


def _fail_rest(ids: list[int], channel_out: BinaryIO) -> None:
    for frame_id in ids:
        write_frame_blocking(channel_out, messages.error(frame_id, 500, INFERENCE_FAILED, 0.0))


def self_check(executor: Executor, mode: str,
               fingerprints: Callable[[], tuple[str, dict[str, str]]]) -> messages.SelfCheck | None:
    """The start-up self-check (clef_worker.starting.self_check) of an executor that has serving
    layouts to check (the native one), or the verdict kept from an earlier start on the same weights
    and code (clef_worker.starting.verdict_store); None for one that has none (the release executor
    runs
    the snapshot's own code, one request at a time)."""
    from clef_worker.native import NativeExecutor

    if not isinstance(executor, NativeExecutor):
        return None
    from clef_worker.starting.verdict_store import checked

    # The variants loaded (a refused checkpoint was fingerprinted but is not served).
    return checked(executor, mode, lambda: fingerprints()[0],
                   variants=lambda: {name: digest for name, digest in fingerprints()[1].items()
                                     if name in executor.variants})


def prefix_cache_state(executor: Executor) -> messages.PrefixCacheInfo | None:
    """The prefix cache's state for `ready`, after the self-check (whose `prefix` probe may
    have turned it off, clef_worker.starting.prefix_probe), emptied of the warm-up's blocks; None
    for
    an executor without one."""
    from clef_worker.native import NativeExecutor

    if not isinstance(executor, NativeExecutor) or executor.runner.prefix_cache is None:
        return None
    executor.runner.prefix_cache.reset()  # warm-up's and the checks' blocks: no client's
    return executor.runner.prefix_cache.info()


def start(args: argparse.Namespace, channel_out: BinaryIO) -> LoadedExecutor | None:
    """Load and warm up; send `ready`, or `fatal` with a reason the operator can act on."""
    started = start_ready(args, channel_out)
    return started[0] if started is not None else None


def start_ready(args: argparse.Namespace, channel_out: BinaryIO, origin: float | None = None
                ) -> tuple[LoadedExecutor, messages.ReadyInfo] | None:
    """`start`, also returning the `ready` frame sent (the serve loop reads its fingerprints).
    `origin`: when the start-up began (`time.perf_counter()`; the worker process passes its
    package's first import), else now; `ready.startup` counts from it, phase by phase
    (clef_worker.starting.startup_clock)."""
    from clef_worker.starting import startup_clock

    clock = startup_clock.begin(origin)
    from clef_worker.fingerprint import (
        VARIANT_FILES,
        DigestCache,
        ModelsWatch,
        SnapshotWatch,
        default_digests_path,
    )
    from clef_worker.loading import base_names, finetunes_of, load_executor, resolve_snapshot

    clock.since_origin("imports_s")
    try:
        with clock.phase("load_s"):
            snapshot, demo = resolve_snapshot(args.model)
            # Resolved once per start, against the base's names: what the directories hold now
            # (a roll or a replacement serves what is there then; refused entries are logged).
            finetunes = finetunes_of(args)
            # The files as they are before the executor reads any: the fingerprints are trusted
            # only if they are the same once computed (clef_worker.fingerprint); a variant's
            # adapter and head files are watched the same way.
            digests = DigestCache(default_digests_path())
            watch = ModelsWatch(
                SnapshotWatch(snapshot, digests),
                {finetune.name: SnapshotWatch(finetune.checkpoint, digests, only=VARIANT_FILES)
                 for finetune in finetunes})
            executor = load_executor(args, snapshot, demo, finetunes)
        fingerprints = watch.start()  # hashed while the worker warms up
        started = time.perf_counter()
        captured = clock.phases["capture_s"]
        executor.warm_up()  # the native warm-up times its graph capture itself (capture_s)
        warmup_ms = _elapsed_ms(started)
        clock.add("warm_s", warmup_ms / 1000.0 - (clock.phases["capture_s"] - captured))
        with clock.phase("fingerprint_s"):
            fingerprints.result()
        # May drop graphs: describe after it.
        with clock.phase("check_s"):
            verdict = self_check(executor, args.self_check, fingerprints.result)
        prefix_cache = prefix_cache_state(executor)
        if args.finetune:
            _answer_only_to_served_names(executor, base_names(args))
        described = executor.describe()
        weights = weights_of(described, *fingerprints.result())
        model = dataclasses.replace(described, fingerprint=weights.base,
                                    models=weights.by_name(base_names(args)[0]))
    except StartupError as exc:
        reason = str(exc)
    except Exception as exc:
        log.error("start-up failed:\n%s", traceback.format_exc())
        reason = f"{type(exc).__name__}: {exc}"
    else:
        times = clock.times()
        ready = messages.ReadyInfo(
            **dataclasses.asdict(model),
            pid=os.getpid(), thread=threading.current_thread().name, warmup_ms=warmup_ms,
            pings=True,  # `serve` answers every ping between forwards
            **executor.policy.ready_fields(),  # type: ignore[arg-type]
            self_check=verdict,
            prefix_cache=prefix_cache,
            startup=times,
        )
        log.info("ready in %.1f s (%s; warm-up %.0f ms)%s", times.ready_s,
                 ", ".join(f"{name} {seconds:.1f}" for name, seconds in times.phases.items()),
                 warmup_ms, f" (kernel cache {ready.kernel_cache} at start)"
                 if ready.kernel_cache else "")
        write_frame_blocking(channel_out, messages.ready(ready))
        return executor, ready
    log.error("cannot start: %s", reason)
    write_frame_blocking(channel_out, messages.fatal(reason))
    return None


def _answer_only_to_served_names(executor: Executor, names: tuple[str, ...]) -> None:
    """With variants a body's `model` chooses what scores it: from now on (warm-up and the
    self-check use names of their own) the base answers only to its served names, so a variant
    this worker does not have (its checkpoint removed since the front listed it) is refused,
    never scored by the base."""
    from clef_worker.native import NativeExecutor

    if isinstance(executor, NativeExecutor):
        executor.serve_base_as(names)


def weights_of(described: messages.ModelInfo, base: str,
               variants: Mapping[str, str]) -> messages.Weights:
    """The one description of this worker's weights: the base's fingerprint and each variant
    the executor loaded (in its order) with its own; a checkpoint refused at load (its
    fingerprint was taken all the same) is not in it."""
    loaded = [str(item.get("name")) for item in described.finetunes]
    return messages.Weights(base, {name: variants.get(name, "") for name in loaded})


def answer_weights(ready: messages.ReadyInfo) -> dict[str, str]:
    """What each answer's `weights` is, by `Answer.model`: "" (the base) to the base's
    fingerprint, each variant's name to its own."""
    return {**ready.weights.variants, "": ready.weights.base}


def warm_only(args: argparse.Namespace) -> int:
    """`--warm-only`: the whole start-up with the `ready` frame sent nowhere, then exit; what it
    leaves behind is the point: the kernel cache filled for this snapshot, GPU and libraries
    (clef_worker.starting.kernel_cache) and the self-check's verdict kept
    (clef_worker.starting.verdict_store),
    so the next worker on the same volume starts warm and skips the check."""
    import io

    from clef_worker import FIRST_IMPORT

    # Run from a shell or an init container, not a front: Ctrl-C and SIGTERM stop it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    configure_logs(log_format=args.log_format)
    keep_freed_memory()
    started = start_ready(args, io.BytesIO(), origin=FIRST_IMPORT)
    if started is None:
        return 1
    _, ready = started
    log.info("warm-only: done (kernel cache %s at start, self-check %s); exiting",
             ready.kernel_cache or "not used",
             "off" if ready.self_check is None else
             "kept from an earlier start" if ready.self_check.reused else
             "passed and kept" if ready.self_check.passed else "failed")
    return 0


def main(argv: list[str] | None = None) -> int:
    from clef_worker.parent import die_with_parent
    from clef_worker.stdio import claim_channel

    # First of all: a worker whose front is gone must not load a model nobody will ask for.
    if die_with_parent() is None:
        return 1  # nobody is left to read the status
    channel_in, channel_out = claim_channel()
    # The front decides when the worker stops: after draining it sends `shutdown` (or closes
    # stdin), and it SIGKILLs a worker that does not exit. Ctrl-C on a terminal, or a service
    # manager signalling every process of the service, must not kill the request in flight.
    # The worker cannot outlive the front: the front's exit closes stdin, which ends the loop,
    # and a front that dies while the worker starts takes it along (clef_worker.parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logs()
    args = parse_args(argv)
    if args.warm_only:
        return warm_only(args)
    configure_logs(log_format=args.log_format)
    enable_stack_dumps()
    keep_freed_memory()
    from clef_worker import FIRST_IMPORT

    started = start_ready(args, channel_out, origin=FIRST_IMPORT)
    if started is None:
        return 1
    executor, ready = started
    return serve(executor, channel_in, channel_out, executor.policy,
                 weights=answer_weights(ready))

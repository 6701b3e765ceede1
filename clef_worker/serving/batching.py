"""Micro-batching in the worker: every request already waiting goes through as few forwards as
the batch policy allows.

Why: one short request does not fill a GPU; several in one forward cost little more than one.
The front keeps up to the worker's `max_sequences` requests in flight to it; the serve loop
(clef_worker.main) reads the first frame, then every further request frame already in the pipe
(waiting up to `--batch-window-ms` for more), and hands them here in admission order (the front
has already put interactive requests before bulk ones).

Groups (`GroupCutter`): consecutive requests, in admission order, while the forward's token cost
(`BatchingExecutor.batch_tokens`: the real tokens of a packed row, laid back to back also
when a graph replays it; rows x bucket for a padded batch) stays within `--max-batch-tokens` and its
requests within `--max-batch`. Work-conserving: a lone request runs at once, a group is never
held back to wait for company (only `--batch-window-ms`, default 0, waits). The layouts
themselves (packed with cumulative offsets, or right-padded rows) are the runner's
(clef_worker.serving.runner).

Overlap (`answer_groups` with a `HostHelper`): parsing, validation, tokenising, encoding and the
next group's host tensors (pinned on CUDA) run on one helper thread while the main thread runs
the current group's forward; every CUDA call (the copy to the device, the forward, the head)
stays on the main thread, which owns the device.

Isolation: a request that fails parsing, validation or encoding gets its own error reply and
never enters the forward. If a batched forward raises, its requests are rerun one by one, so one
bad request cannot fail its neighbours. Replies go out in admission order, group by group.
"""

from __future__ import annotations

import io
import logging
import queue
import select
import threading
import time
import traceback
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from clef_protocol.errors import BadRequestBody
from clef_worker.errors import ExecutorBroken
from clef_worker.serving.executor import Answer, Executor
from clef_worker.serving.policy import BatchPolicy

log = logging.getLogger(__name__)

NO_BODY = "request frame has no body"


class BatchingExecutor(Protocol):
    """What the serve loop runs requests through: prepare each body, then answer groups of
    prepared requests with shared forwards. `NativeExecutor` implements it; an executor that
    only answers one body at a time is adapted by `OneAtATime`, so there is one serve path."""

    def prepare(self, body: bytes) -> Any:
        """Parse, validate and encode; raises like `Executor.answer` does for a refused request.
        Host work only: it may run on the helper thread."""
        ...

    def prepared_length(self, prepared: Any) -> int:
        """The token count of a prepared request."""
        ...

    def batch_tokens(self, lengths: Sequence[int]) -> int:
        """What one forward of requests of these lengths costs against `--max-batch-tokens`."""
        ...

    def runs_alone(self, prepared: Any) -> bool:
        """Whether this request must have a forward of its own (media, an unbatched executor)."""
        ...

    def stage(self, batch: Sequence[Any]) -> Any:
        """The group's host work before its forward (host tensors, pinned memory); no CUDA
        call, so it may run on the helper thread while another group's forward runs."""
        ...

    def answer_staged(self, staged: Any) -> list[Answer]:
        """Forwards over a staged group, one answer per request, in order; raises on failure.
        Each answer's `batch_size` says how many requests the forward that produced it held.
        On the main thread."""
        ...


class OneAtATime:
    """Adapts an executor that answers one raw body at a time (the release executor, test
    doubles) to `BatchingExecutor`: the body is its own prepared form and every request runs
    alone, so the serve loop, its error mapping and its timing are the same for every executor."""

    def __init__(self, executor: Executor):
        self.executor = executor

    def prepare(self, body: bytes) -> bytes:
        return body

    def prepared_length(self, prepared: bytes) -> int:
        return 1

    def batch_tokens(self, lengths: Sequence[int]) -> int:
        return sum(lengths)

    def runs_alone(self, prepared: bytes) -> bool:
        return True

    def stage(self, batch: Sequence[bytes]) -> Sequence[bytes]:
        return batch

    def answer_staged(self, staged: Sequence[bytes]) -> list[Answer]:
        return [self.executor.answer(body) for body in staged]


def answer_prepared(executor: BatchingExecutor, batch: Sequence[Any]) -> list[Answer]:
    """Stage and answer one group on the calling thread."""
    return executor.answer_staged(executor.stage(batch))


def as_batching(executor: object) -> BatchingExecutor:
    """The executor itself when it batches, else adapted by `OneAtATime`."""
    if supports_batching(executor):
        return executor  # type: ignore[return-value]
    return OneAtATime(executor)  # type: ignore[arg-type]


BATCHING_METHODS = ("prepare", "prepared_length", "batch_tokens", "runs_alone", "stage",
                    "answer_staged")


def supports_batching(executor: object) -> bool:
    return all(callable(getattr(executor, name, None)) for name in BATCHING_METHODS)


# -- which frames are waiting --------------------------------------------------------------------


def frame_waiting(stream: BinaryIO, timeout_s: float) -> bool:
    """Whether more bytes can be read from the channel without blocking (after up to
    `timeout_s`). Works on the worker's unbuffered pipe and on in-memory streams (tests); any
    other stream reports False, which simply disables batching."""
    if isinstance(stream, io.BytesIO):
        return stream.tell() < stream.getbuffer().nbytes
    if not isinstance(stream, io.FileIO):
        return False
    readable, _, _ = select.select([stream.fileno()], [], [], max(0.0, timeout_s))
    return bool(readable)


# -- grouping ------------------------------------------------------------------------------------


class GroupCutter:
    """Cuts requests, fed one at a time in admission order, into consecutive groups: a group
    ends before the request that would take its `cost` (`BatchingExecutor.batch_tokens` of its
    lengths) past `max_tokens` or its size past `max_sequences`; a request over the budget
    alone forms a group, and so does a request that must run alone. A request that failed
    before the forward (`length` None) joins the current group free (its reply goes out with
    the group's).

    Incremental, so the helper thread can hand a group to the main thread as soon as the
    request after it is encoded, without encoding the whole read first."""

    def __init__(self, cost: Callable[[Sequence[int]], int], max_tokens: int,
                 max_sequences: int):
        self.cost = cost
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.current: list[int] = []
        self.lengths: list[int] = []
        self.solo = False  # the current group holds a request that must run alone

    def add(self, position: int, length: int | None, alone: bool = False) -> list[int] | None:
        """Take the next request; returns the group it closed, if it closed one."""
        if length is None:
            self.current.append(position)
            return None
        closed = None
        if self.lengths and (self.solo or alone or len(self.lengths) >= self.max_sequences
                             or self.cost([*self.lengths, length])
                             > self.max_tokens):
            closed = self.finish()
        self.current.append(position)
        self.lengths.append(length)
        if len(self.lengths) == 1:
            self.solo = alone
        return closed

    def finish(self) -> list[int] | None:
        """Close the current group (None when it is empty)."""
        group, self.current, self.lengths, self.solo = self.current, [], [], False
        return group or None


@dataclass
class Outcome:
    """One request's result: an answer or the exception it raised (the serve loop maps it to a
    reply frame), and the milliseconds its preparation (parse, validate, encode) took."""

    value: Any = None  # the Answer (Any: tests and callers read it without narrowing)
    error: BaseException | None = None
    encode_ms: float = 0.0

    @property
    def batch_size(self) -> int:
        """Requests in the forward that produced the answer (1 for an error)."""
        return self.value.batch_size if self.value is not None else 1

    def stages(self) -> dict[str, float]:
        """The worker's stage times for tracing: the request's own preparation, then the
        forward's and the head's (shared by every request of a batched forward); empty when the
        executor does not time its stages."""
        if self.value is None or not self.value.stages:
            return {}
        return {"encode_ms": round(self.encode_ms, 3), **self.value.stages}


# -- preparing (host) and answering (device) -----------------------------------------------------


@dataclass
class Group:
    """One forward's worth of requests, prepared on the host: the positions it answers (failed
    ones included), the outcomes of those that failed before the forward, and the staged host
    work of the rest (`staged` None when none is left, `stage_error` when staging raised)."""

    positions: list[int]
    members: list[int]
    items: list[Any]
    failed: dict[int, Outcome]
    encode_ms: dict[int, float]
    staged: Any = None
    stage_error: BaseException | None = None


def _prepare_groups(executor: BatchingExecutor, bodies: Sequence[object], policy: BatchPolicy,
                    stop: threading.Event | None = None) -> Generator[Group, None, None]:
    """Prepare every body in order and yield each group, staged, as soon as it is cut: all host
    work, none of it touching the device."""
    cutter = GroupCutter(executor.batch_tokens, policy.max_batch_tokens, policy.max_sequences)
    prepared: dict[int, Any] = {}
    failed: dict[int, Outcome] = {}
    encode_ms: dict[int, float] = {}

    def group_of(positions: list[int]) -> Group:
        members = [p for p in positions if p not in failed]
        group = Group(positions, members, [prepared.pop(p) for p in members],
                      {p: failed.pop(p) for p in positions if p in failed},
                      {p: encode_ms.pop(p) for p in positions})
        if group.items:
            try:
                group.staged = executor.stage(group.items)
            except Exception as exc:
                group.stage_error = exc
        return group

    for position, body in enumerate(bodies):
        if stop is not None and stop.is_set():
            return
        started = time.perf_counter()
        length: int | None = None
        alone = False
        try:
            if not isinstance(body, bytes):
                raise BadRequestBody(NO_BODY)
            item = executor.prepare(body)
            length, alone = executor.prepared_length(item), executor.runs_alone(item)
            prepared[position] = item
        except Exception as exc:
            failed[position] = Outcome(error=exc)
        encode_ms[position] = (time.perf_counter() - started) * 1000.0
        closed = cutter.add(position, length, alone)
        if closed:
            yield group_of(closed)
    last = cutter.finish()
    if last:
        yield group_of(last)


class HostHelper:
    """The one helper thread of a worker's serve loop: it prepares and stages the next groups
    while the main thread runs the current forward. At most `ahead` staged groups wait, so host
    memory (pinned buffers) stays bounded whatever the read held.

    The producer never blocks for good: every hand-over gives up once the consumer has stopped
    (`stop`), which the consumer sets when it closes its generator and `close` sets too, so a
    serve loop that leaves a read early (a broken device) never waits on its helper. Callers
    close the generator explicitly (`contextlib.closing`): an outcome holding an exception can
    keep the generator's frame alive in a reference cycle, where only the garbage collector
    would ever close it."""

    def __init__(self, ahead: int = 1):
        self.ahead = ahead
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-host")
        self._stops: set[threading.Event] = set()

    def groups(self, executor: BatchingExecutor, bodies: Sequence[object],
               policy: BatchPolicy) -> Generator[Group, None, None]:
        """The groups of `_prepare_groups`, produced on the helper thread."""
        handoff: queue.Queue[Group | BaseException | None] = queue.Queue(maxsize=self.ahead)
        stop = threading.Event()
        self._stops.add(stop)

        def offer(item: Group | BaseException | None) -> None:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return
                except queue.Full:
                    continue

        def produce() -> None:
            try:
                for group in _prepare_groups(executor, bodies, policy, stop):
                    offer(group)
                offer(None)
            except BaseException as exc:  # a bug in the helper must reach the serve loop
                offer(exc)

        future = self.pool.submit(produce)
        try:
            while True:
                got = handoff.get()
                if got is None:
                    return
                if isinstance(got, BaseException):
                    raise got
                yield got
        finally:
            stop.set()
            self._stops.discard(stop)
            future.result()  # the producer gives up within one hand-over timeout

    def close(self) -> None:
        for stop in list(self._stops):
            stop.set()
        self.pool.shutdown(wait=True)


def answer_groups(executor: BatchingExecutor, bodies: Sequence[object], policy: BatchPolicy,
                  helper: HostHelper | None = None
                  ) -> Generator[list[tuple[int, Outcome]], None, None]:
    """Yield the (position, outcome) pairs of each forward's group as soon as it is done, in
    order: the serve loop writes a group's replies together. With a `helper`, the host work
    of later groups runs on its thread while this one's forward runs here.

    A body that is not bytes (a malformed frame) gets a BadRequestBody outcome (400).
    """
    groups = (helper.groups(executor, bodies, policy) if helper is not None
              else _prepare_groups(executor, bodies, policy))
    try:
        for group in groups:
            outcomes = dict(group.failed)
            if group.items:
                outcomes.update(_run_group(executor, group))
            for position in group.members:
                outcomes[position].encode_ms = group.encode_ms[position]
            yield [(position, outcomes.pop(position)) for position in group.positions]
    finally:
        groups.close()  # stops the helper now, whoever holds this generator's frame


def _run_group(executor: BatchingExecutor, group: Group) -> dict[int, Outcome]:
    """One forward for the group; if it raises, each request alone (isolation)."""
    items, positions = group.items, group.members
    try:
        if group.stage_error is not None:
            raise group.stage_error
        answers = executor.answer_staged(group.staged)
    except ExecutorBroken as exc:
        # The device is gone: rerunning would fail the same way; fail the whole group.
        return {position: Outcome(error=exc) for position in positions}
    except Exception as exc:
        if len(items) == 1:
            return {positions[0]: Outcome(error=exc)}
        log.warning("a batched forward of %d requests failed; rerunning them one by one:\n%s",
                    len(items), traceback.format_exc())
        return {position: _solo(executor, item) for position, item in zip(positions, items,
                                                                            strict=True)}
    return {position: Outcome(value=answer)
            for position, answer in zip(positions, answers, strict=True)}


def _solo(executor: BatchingExecutor, item: Any) -> Outcome:
    try:
        return Outcome(value=answer_prepared(executor, [item])[0])
    except Exception as exc:
        return Outcome(error=exc)

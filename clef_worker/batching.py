"""Micro-batching in the worker: every request already waiting goes through one forward.

Why: one short request does not fill a GPU; several in one forward cost little more than one.
The front may keep several requests in flight to the worker (its `--max-batch`); the serve loop
(clef_worker.main) reads the first frame, then every further request frame already in the pipe
(waiting up to `--batch-window-ms` for more), and hands them here in admission order.

Packing: right-padded `[B, T]` rows, T the bucket of the longest request (clef_worker.gpu.buckets).
The stack is causal, so a row's real positions never see its padding, and no attention mask is
needed; the head then runs per request on its real rows, exactly as for a solo request. Chosen
over packing all requests into one row with `cu_seqlens` because (1) fla's varlen path derives
chunk indices on the host and cannot be graph-captured, while the fixed-shape path can;
(2) transformers' torch Gated DeltaNet path (CPU, float32) has no varlen form at all; (3) the
waste of padding is bounded by `--max-batch-tokens`, which counts padded tokens (B x T), and
groups are cut in admission order so a long request does not pad a batch of short ones beyond
that budget. Measured on CPU in docs/benchmarks.md; the GPU comparison is still to be made.

Isolation: a request that fails parsing, validation or encoding gets its own error reply and
never enters the forward. If a packed forward raises, its requests are rerun one by one, so one
bad request cannot fail its neighbours. Replies go out in admission order, group by group.
"""

from __future__ import annotations

import io
import logging
import select
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

from clef_protocol.errors import BadRequestBody
from clef_protocol.options import DEFAULT_MAX_BATCH_TOKENS
from clef_worker.errors import ExecutorBroken
from clef_worker.executor import Answer, Executor

log = logging.getLogger(__name__)

NO_BODY = "request frame has no body"


@dataclass(frozen=True)
class BatchPolicy:
    """How much the worker puts into one forward, and how long it waits for company."""

    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # padded tokens (rows x bucket) per forward
    window_ms: float = 0.0


class BatchingExecutor(Protocol):
    """What the serve loop runs requests through: prepare each body, then answer groups of
    prepared requests with shared forwards. `NativeExecutor` implements it; an executor that
    only answers one body at a time is adapted by `OneAtATime`, so there is one serve path."""

    def prepare(self, body: bytes) -> Any:
        """Parse, validate and encode; raises like `Executor.answer` does for a refused request."""
        ...

    def prepared_length(self, prepared: Any) -> int:
        """The token count of a prepared request."""
        ...

    def padded_length(self, length: int) -> int:
        """The row length a forward of requests up to `length` tokens runs at."""
        ...

    def runs_alone(self, prepared: Any) -> bool:
        """Whether this request must have a forward of its own (media, an unbatched executor)."""
        ...

    def answer_prepared(self, batch: Sequence[Any]) -> list[Answer]:
        """Forwards over the batch, one answer per request, in order; raises on failure. Each
        answer's `batch_size` says how many requests the forward that produced it held."""
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

    def padded_length(self, length: int) -> int:
        return length

    def runs_alone(self, prepared: bytes) -> bool:
        return True

    def answer_prepared(self, batch: Sequence[bytes]) -> list[Answer]:
        return [self.executor.answer(body) for body in batch]


def as_batching(executor: object) -> BatchingExecutor:
    """The executor itself when it batches, else adapted by `OneAtATime`."""
    if supports_batching(executor):
        return executor  # type: ignore[return-value]
    return OneAtATime(executor)  # type: ignore[arg-type]


BATCHING_METHODS = ("prepare", "prepared_length", "padded_length", "runs_alone", "answer_prepared")


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


# -- grouping and answering ----------------------------------------------------------------------


def plan_groups(lengths: Sequence[int | None], padded_length: Callable[[int], int],
                max_tokens: int, alone: Sequence[bool] = ()) -> list[list[int]]:
    """Cut requests (in order) into consecutive groups whose padded cost, rows x padded length
    of the longest, stays within `max_tokens`; a request over the budget alone forms a group,
    and so does a request marked in `alone` (it must run by itself).
    `None` marks a request that failed before the forward: it joins the current group free."""
    groups: list[list[int]] = []
    current: list[int] = []
    rows = 0
    longest = 0
    solo = False  # the current group holds a request that must run alone
    for position, length in enumerate(lengths):
        if length is None:
            current.append(position)
            continue
        grown = max(longest, length)
        must_be_alone = position < len(alone) and alone[position]
        if rows and (solo or must_be_alone or (rows + 1) * padded_length(grown) > max_tokens):
            groups.append(current)
            current, rows, longest = [], 0, 0
            grown = length
        current.append(position)
        rows += 1
        longest = grown
        if rows == 1:
            solo = must_be_alone
    if current:
        groups.append(current)
    return groups


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


def answer_batch(executor: BatchingExecutor, bodies: Sequence[object],
                 policy: BatchPolicy) -> Iterator[tuple[int, Outcome]]:
    """Yield (position, outcome) for every body, in order, group by group."""
    for group in answer_groups(executor, bodies, policy):
        yield from group


def answer_groups(executor: BatchingExecutor, bodies: Sequence[object],
                  policy: BatchPolicy) -> Iterator[list[tuple[int, Outcome]]]:
    """Yield the (position, outcome) pairs of each forward's group as soon as it is done, in
    order: the serve loop writes a group's replies together.

    A body that is not bytes (a malformed frame) gets a BadRequestBody outcome (400).
    """
    prepared: list[Any] = []
    encode_ms: list[float] = []
    outcomes: dict[int, Outcome] = {}
    for position, body in enumerate(bodies):
        started = time.perf_counter()
        try:
            if not isinstance(body, bytes):
                raise BadRequestBody(NO_BODY)
            prepared.append(executor.prepare(body))
        except Exception as exc:
            prepared.append(None)
            outcomes[position] = Outcome(error=exc)
        encode_ms.append((time.perf_counter() - started) * 1000.0)
    lengths = [None if position in outcomes else executor.prepared_length(item)
               for position, item in enumerate(prepared)]
    alone = [position not in outcomes and executor.runs_alone(item)
             for position, item in enumerate(prepared)]
    for group in plan_groups(lengths, executor.padded_length, policy.max_batch_tokens, alone):
        members = [position for position in group if position not in outcomes]
        if members:
            outcomes.update(_run_group(executor, [prepared[p] for p in members], members))
        for position in members:
            outcomes[position].encode_ms = encode_ms[position]
        yield [(position, outcomes.pop(position)) for position in group]


def _run_group(executor: BatchingExecutor, items: list[Any],
               positions: list[int]) -> dict[int, Outcome]:
    """One forward for the group; if it raises, each request alone (isolation)."""
    try:
        answers = executor.answer_prepared(items)
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
        return Outcome(value=executor.answer_prepared([item])[0])
    except Exception as exc:
        return Outcome(error=exc)

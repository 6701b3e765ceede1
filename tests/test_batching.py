"""Micro-batching in the worker: grouping, batched answers equal to solo answers for every golden
case mixed in random batches (truncated and refused cases included), isolation of bad requests,
and the serve loop taking every frame already waiting on a real pipe."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchlib.executors import with_limits
from clef_protocol import messages
from clef_protocol.errors import BadRequestBody, RequestInvalid
from clef_protocol.frames import encode_frame, read_frame_blocking
from clef_protocol.options import DEFAULT_MAX_BATCH_TOKENS, RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import ExecutorBroken
from clef_worker.main import parse_args, serve
from clef_worker.native import NativeExecutor, Prepared
from clef_worker.serving.batching import (
    BatchingExecutor,
    GroupCutter,
    HostHelper,
    OneAtATime,
    Outcome,
    answer_groups,
    as_batching,
    frame_waiting,
)
from clef_worker.serving.executor import Answer
from clef_worker.serving.policy import BatchPolicy
from tests.answer_compare import assert_same_response
from tests.conftest import GOLDEN
from tests.request_strategies import requests

CASES = [json.loads(line) for line in GOLDEN.read_text(encoding="utf-8").splitlines() if line]
BIG = BatchPolicy(max_batch_tokens=1 << 30, max_sequences=1 << 30)


# Test-only helpers over the serve loop's own parts (not in the production module).
def plan_groups(lengths: Sequence[int | None], cost: Callable[[Sequence[int]], int],
                max_tokens: int, alone: Sequence[bool] = (),
                max_sequences: int = sys.maxsize) -> list[list[int]]:
    """All the groups `GroupCutter` makes of these lengths (in order); `None` marks a request
    that failed before the forward."""
    cutter = GroupCutter(cost, max_tokens, max_sequences)
    groups = []
    for position, length in enumerate(lengths):
        closed = cutter.add(position, length, position < len(alone) and alone[position])
        if closed:
            groups.append(closed)
    last = cutter.finish()
    return [*groups, last] if last else groups


def answer_batch(executor: BatchingExecutor, bodies: Sequence[object],
                 policy: BatchPolicy) -> Iterator[tuple[int, Outcome]]:
    """Every body's (position, outcome), in order, group by group."""
    for group in answer_groups(executor, bodies, policy):
        yield from group


def rows_times(padded: Callable[[int], int]) -> Callable[[Sequence[int]], int]:
    """The padded layout's cost: rows x the longest's padded length."""
    return lambda lengths: len(lengths) * padded(max(lengths))


SAME = rows_times(lambda n: n)


# -- grouping ------------------------------------------------------------------------------------


@given(st.lists(st.none() | st.integers(1, 3000), max_size=40), st.integers(1, 8000))
def test_groups_keep_order_and_the_token_budget(lengths: list[int | None], budget: int) -> None:
    def padded(n: int) -> int:
        return -(-n // 64) * 64

    groups = plan_groups(lengths, rows_times(padded), budget)
    assert [p for group in groups for p in group] == list(range(len(lengths)))
    for group in groups:
        real = [length for p in group if (length := lengths[p]) is not None]
        if len(real) > 1:
            assert len(real) * padded(max(real)) <= budget


def test_groups_fill_up_to_the_budget() -> None:
    assert plan_groups([64, 64, 64, 64], SAME, 128) == [[0, 1], [2, 3]]
    assert plan_groups([300, 10, None, 10], SAME, 128) == [[0], [1, 2, 3]]
    assert plan_groups([None, None], SAME, 1) == [[0, 1]]


# -- batched answers equal solo answers ----------------------------------------------------------


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               limits=RequestLimits())


def _body(case: dict[str, Any]) -> bytes:
    # the case name rides along (ignored by the model) so the test executor finds its limit
    return json.dumps({**case["request"], "x_case": case["name"]}).encode()


class PerCaseLimits:
    """The real executor, with each golden case encoded under its own max_length (the golden
    file mixes budgets; a worker has one, but the forward does not care)."""

    def __init__(self, executor: NativeExecutor):
        self.executor = executor
        self.forwards: list[int] = []
        self.limited = {
            case["name"]: with_limits(executor, dataclasses.replace(
                executor.limits, max_length=case["max_length"])) for case in CASES}

    def prepare(self, body: bytes) -> Prepared:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the executor itself must refuse this body
        name = parsed.get("x_case") if isinstance(parsed, dict) else None
        return (self.limited.get(name) or self.executor).prepare(body)

    def prepared_length(self, prepared: Prepared) -> int:
        return self.executor.prepared_length(prepared)

    def batch_tokens(self, lengths: Sequence[int]) -> int:
        return self.executor.batch_tokens(lengths)

    def stage(self, batch: Sequence[Prepared]) -> Sequence[Prepared]:
        return batch

    def runs_alone(self, prepared: Prepared) -> bool:
        return self.executor.runs_alone(prepared)

    def answer_staged(self, batch: Sequence[Prepared]) -> list[Answer]:
        self.forwards.append(len(batch))
        return self.executor.answer_prepared(batch)


def _solo(executor: NativeExecutor, case: dict[str, Any]) -> Outcome:
    limited = with_limits(executor, dataclasses.replace(executor.limits,
                                                       max_length=case["max_length"]))
    try:
        return Outcome(value=limited.answer(_body(case)))
    except Exception as exc:
        return Outcome(error=exc)


_SOLO: dict[str, Outcome] = {}


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.permutations(range(len(CASES))), st.integers(1, 8), st.integers(64, 4000))
def test_golden_cases_in_random_batches_answer_as_alone(
        executor: NativeExecutor, order: list[int], size: int, budget: int) -> None:
    for case in CASES:
        if case["name"] not in _SOLO:
            _SOLO[case["name"]] = _solo(executor, case)
    batcher = PerCaseLimits(executor)
    picked = [CASES[i] for i in order[:size]]
    results = list(answer_batch(batcher, [_body(c) for c in picked],
                                BatchPolicy(max_batch_tokens=budget)))
    assert [position for position, _ in results] == list(range(len(picked)))
    for case, (_, outcome) in zip(picked, results, strict=True):
        solo = _SOLO[case["name"]]
        if solo.error is not None:
            assert type(outcome.error) is type(solo.error)
            assert str(outcome.error) == str(solo.error) == case["error"]["message"]
        else:
            assert outcome.error is None
            assert_same_response(outcome.value.body, solo.value.body)
            assert (outcome.value.input_tokens, outcome.value.truncated_tokens) == \
                (solo.value.input_tokens, solo.value.truncated_tokens)
    refused = sum("error" in c for c in picked)
    assert sum(batcher.forwards) == len(picked) - refused  # refused ones never reach a forward


def test_a_full_batch_of_golden_cases_is_one_forward(executor: NativeExecutor) -> None:
    batcher = PerCaseLimits(executor)
    # the short cases (a batch pads every row to its longest), the truncated one among them
    ok = [c for c in CASES if "error" not in c and len(c["input_ids"]) <= 512]
    assert any(c["max_length"] < 16384 for c in ok)
    results = list(answer_batch(batcher, [_body(c) for c in ok], BIG))
    assert batcher.forwards == [len(ok)]
    for case, (_, outcome) in zip(ok, results, strict=True):
        assert_same_response(outcome.value.body, _solo(executor, case).value.body)


# -- isolation -----------------------------------------------------------------------------------


class Poisoned(PerCaseLimits):
    """A forward that contains the request whose model is `poison` raises."""

    def answer_staged(self, batch: Sequence[Prepared]) -> list[Answer]:
        self.forwards.append(len(batch))
        if any(item.request["model"] == "poison" for item in batch):
            raise RuntimeError("kernel blew up")
        return self.executor.answer_prepared(batch)


def test_a_raising_forward_is_rerun_one_by_one(executor: NativeExecutor) -> None:
    ok = [c for c in CASES if "error" not in c][:4]
    poison = json.dumps({**ok[0]["request"], "model": "poison"}).encode()
    bodies = [_body(ok[0]), _body(ok[1]), poison, _body(ok[2]), _body(ok[3])]
    batcher = Poisoned(executor)
    results = dict(answer_batch(batcher, bodies, BIG))
    assert batcher.forwards == [5, 1, 1, 1, 1, 1]
    assert isinstance(results[2].error, RuntimeError)
    for position, case in zip((0, 1, 3, 4), ok, strict=True):
        assert results[position].error is None
        assert results[position].batch_size == 1  # answered by its own forward
        assert_same_response(results[position].value.body, _solo(executor, case).value.body)


def test_invalid_requests_answer_alone_and_stay_out_of_the_forward(
        executor: NativeExecutor) -> None:
    ok = [c for c in CASES if "error" not in c][:2]
    bodies: list[object] = [b"not json", _body(ok[0]),
                            b'{"model": "m", "state": 1, "questions": {}}', None, _body(ok[1])]
    batcher = PerCaseLimits(executor)
    results = dict(answer_batch(batcher, bodies, BIG))
    assert batcher.forwards == [2]
    assert isinstance(results[0].error, BadRequestBody)
    assert isinstance(results[2].error, RequestInvalid)
    assert str(results[2].error) == "at least one question is required"
    assert isinstance(results[3].error, BadRequestBody)
    assert results[1].error is None and results[4].error is None


def test_a_broken_device_fails_the_whole_group_without_reruns(executor: NativeExecutor) -> None:
    class Broken(PerCaseLimits):
        def answer_staged(self, batch: Sequence[Prepared]) -> list[Answer]:
            self.forwards.append(len(batch))
            raise ExecutorBroken("CUDA error: an illegal memory access was encountered")

    batcher = Broken(executor)
    ok = [c for c in CASES if "error" not in c][:3]
    results = dict(answer_batch(batcher, [_body(c) for c in ok], BIG))
    assert batcher.forwards == [3]
    assert all(isinstance(outcome.error, ExecutorBroken) for outcome in results.values())


# -- the serve loop on a real pipe --------------------------------------------------------------


def _pipe_with(*frames: dict[str, Any]) -> io.FileIO:
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "wb") as writer:
        for frame in frames:
            writer.write(encode_frame(frame))
    return os.fdopen(read_fd, "rb", buffering=0)


def _replies(out: io.BytesIO) -> list[dict[str, Any]]:
    stream = io.BytesIO(out.getvalue())
    replies = []
    while (frame := read_frame_blocking(stream)) is not None:
        replies.append(frame)
    return replies


class CountingOut(io.BytesIO):
    """The worker's output, remembering how many bytes each write carried."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []

    def write(self, data: Any) -> int:
        self.writes.append(len(data))
        return super().write(data)


def test_serve_takes_every_waiting_frame_into_one_forward(executor: NativeExecutor) -> None:
    ok = [c for c in CASES if "error" not in c][:5]
    batcher = PerCaseLimits(executor)
    frames = [messages.request(10 + i, _body(c)) for i, c in enumerate(ok)]
    channel = _pipe_with(*frames, messages.request(99, b"[]"), messages.shutdown())
    out = CountingOut()
    assert serve(batcher, channel, out) == 0
    replies = _replies(out)
    assert [r["id"] for r in replies] == [10, 11, 12, 13, 14, 99]
    assert batcher.forwards == [5]
    assert out.writes == [len(out.getvalue())]  # the forward's six replies leave in one write
    assert [r.get("batch_size") for r in replies] == [5] * 5 + [None]  # the refusal: no forward
    # the shared forward's stage times travel with each of its replies, with the request's own
    # encoding time
    stages = [r["stages"] for r in replies[:-1]]
    assert all(set(s) == {"encode_ms", "forward_ms", "head_ms"} for s in stages)
    assert len({(s["forward_ms"], s["head_ms"]) for s in stages}) == 1
    assert all(s["forward_ms"] > 0 and s["encode_ms"] > 0 for s in stages)
    assert "stages" not in replies[-1]
    assert [r["kind"] for r in replies] == ["response"] * 5 + ["error"]
    assert replies[-1]["status"] == 400
    for case, reply in zip(ok, replies[:-1], strict=True):
        assert_same_response(reply["body"], _solo(executor, case).value.body)


def _serve_one_per_forward(executor: NativeExecutor, batcher: PerCaseLimits,
                           out: io.BytesIO) -> int:
    """Serve three golden requests with a token budget that fits one of them per forward."""
    ok = [c for c in CASES if "error" not in c and c["max_length"] == 16384][:3]
    longest = max(len(executor.prepare(_body(c)).encoding.input_ids) for c in ok)
    channel = _pipe_with(*(messages.request(i, _body(c)) for i, c in enumerate(ok)))
    return serve(batcher, channel, out, BatchPolicy(max_batch_tokens=longest))


def test_serve_cuts_forwards_at_the_token_budget(executor: NativeExecutor) -> None:
    batcher = PerCaseLimits(executor)
    out = CountingOut()
    assert _serve_one_per_forward(executor, batcher, out) == 0
    assert batcher.forwards == [1, 1, 1]
    assert [r["id"] for r in _replies(out)] == [0, 1, 2]
    assert len(out.writes) == 3  # each forward's reply as soon as it is done


def test_a_broken_device_mid_batch_fails_that_batch_and_the_worker_exits(
        executor: NativeExecutor) -> None:
    class Broken(PerCaseLimits):
        def answer_staged(self, batch: Sequence[Prepared]) -> list[Answer]:
            self.forwards.append(len(batch))
            if len(self.forwards) == 2:
                raise ExecutorBroken("CUDA error: an illegal memory access was encountered")
            return self.executor.answer_prepared(batch)

    batcher = Broken(executor)
    out = io.BytesIO()
    assert _serve_one_per_forward(executor, batcher, out) == 3
    replies = _replies(out)
    assert [(r["id"], r.get("status")) for r in replies] == [(0, 200), (1, 500), (2, 500)]
    assert batcher.forwards == [1, 1]  # the request after the broken one never ran


def test_frame_waiting_sees_the_pipe_and_in_memory_streams() -> None:
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb", buffering=0) as reader:
        assert not frame_waiting(reader, 0)
        os.write(write_fd, encode_frame(messages.shutdown()))
        assert frame_waiting(reader, 0)
        os.close(write_fd)
    memory = io.BytesIO(encode_frame(messages.shutdown()))
    assert frame_waiting(memory, 0)
    read_frame_blocking(memory)
    assert not frame_waiting(memory, 0)
    assert not frame_waiting(io.BufferedReader(io.BytesIO(b"x")), 0)


def test_a_request_that_must_run_alone_gets_a_group_of_its_own() -> None:
    alone = [False, True, False, False, True, True]
    groups = plan_groups([10, 10, 10, 10, 10, 10], SAME, 1000, alone)
    assert groups == [[0], [1], [2, 3], [4], [5]]
    assert plan_groups([10, None, 10], SAME, 1000, [True, False, False]) == [[0, 1], [2]]


class OneBody:
    """An executor that only answers raw bodies (like the release executor)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def answer(self, body: bytes) -> Answer:
        self.bodies.append(body)
        return Answer(body[::-1])


def test_an_executor_that_does_not_batch_is_adapted_to_one_forward_per_request() -> None:
    plain = OneBody()
    adapted = as_batching(plain)
    assert isinstance(adapted, OneAtATime)
    results = list(answer_groups(adapted, [b"ab", b"cd", None], BIG))
    assert [[(p, o.value.body if o.value else type(o.error)) for p, o in g] for g in results] == [
        [(0, b"ba")], [(1, b"dc"), (2, BadRequestBody)]]
    assert plain.bodies == [b"ab", b"cd"]
    assert all(o.batch_size == 1 and o.stages() == {} for g in results for _, o in g)


def test_a_media_request_runs_alone_and_says_so(executor: NativeExecutor) -> None:
    from tests.conftest import MEDIA_GOLDEN

    media_cases = [json.loads(line) for line in MEDIA_GOLDEN.read_text(encoding="utf-8")
                   .splitlines() if line]
    image = next(c for c in media_cases if "error" not in c and c["request"].get("images"))
    image = {**image, "name": "media:" + image["name"]}
    text = [c for c in CASES if "error" not in c][:2]
    batcher = PerCaseLimits(executor)
    batcher.limited[image["name"]] = with_limits(executor, dataclasses.replace(
        executor.limits, max_length=image["max_length"]))
    picked = [text[0], text[1], image]
    results = list(answer_batch(batcher, [_body(c) for c in picked], BIG))
    assert batcher.forwards == [2, 1]
    assert [outcome.batch_size for _, outcome in results] == [2, 2, 1]
    for case, (_, outcome) in zip(picked, results, strict=True):
        assert outcome.error is None
        assert_same_response(outcome.value.body, _solo(executor, case).value.body)
    assert_same_response(results[2][1].value.body, json.dumps(image["response"]).encode())


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(requests(), min_size=2, max_size=5))
def test_random_requests_in_one_batch_answer_as_alone(executor: NativeExecutor,
                                                      batch: list[dict[str, Any]]) -> None:
    bodies = [json.dumps(request).encode() for request in batch]
    results = list(answer_batch(executor, bodies, BIG))
    for body, (_, outcome) in zip(bodies, results, strict=True):
        try:
            solo = executor.answer(body)
        except RequestInvalid as refused:
            assert isinstance(outcome.error, RequestInvalid)
            assert str(outcome.error) == str(refused)
            continue
        assert outcome.error is None
        assert_same_response(outcome.value.body, solo.body)
        assert outcome.value.input_tokens == solo.input_tokens


def test_the_token_budget_defaults_by_device() -> None:
    """On CPU eight ~500-token requests share a forward and a ninth waits for the next one (the
    measured optimum, docs/benchmarks.md); CUDA keeps the large budget; a given flag wins."""
    cpu = BatchPolicy.from_flags("cpu", parse_args(["--model", "m", "--device", "cpu"]))
    assert plan_groups([500] * 9, SAME, cpu.max_batch_tokens) == [list(range(8)), [8]]
    cuda = BatchPolicy.resolve("cuda:1")
    assert cuda.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS
    assert plan_groups([480, 500, 470], SAME, cuda.max_batch_tokens) == [[0, 1, 2]]
    given = BatchPolicy.from_flags("cpu", parse_args(["--model", "m", "--max-batch-tokens", "7"]))
    assert given.max_batch_tokens == 7


def test_packed_groups_count_real_tokens_and_requests() -> None:
    """The packed cost is the sum of the lengths; a group also ends at `max_sequences`."""
    assert plan_groups([1000, 3000, 96, 2000], sum, 4096) == [[0, 1, 2], [3]]
    assert plan_groups([10] * 5, sum, 4096, max_sequences=2) == [[0, 1], [2, 3], [4]]
    # the padded cost of the first pair would be 2 x 3000 > 4096: it cuts one more group
    assert plan_groups([1000, 3000, 96, 2000], SAME, 4096) == [[0], [1], [2, 3]]


class ThreadRecorder(PerCaseLimits):
    """Records the thread each half of a group ran on."""

    def __init__(self, executor: NativeExecutor):
        super().__init__(executor)
        self.threads: dict[str, set[str]] = {"prepare": set(), "stage": set(), "answer": set()}

    def prepare(self, body: bytes) -> Prepared:
        self.threads["prepare"].add(threading.current_thread().name)
        return super().prepare(body)

    def stage(self, batch: Sequence[Prepared]) -> Any:
        self.threads["stage"].add(threading.current_thread().name)
        return self.executor.stage(batch)

    def answer_staged(self, staged: Any) -> list[Answer]:
        self.threads["answer"].add(threading.current_thread().name)
        self.forwards.append(len(staged[0]))
        return self.executor.answer_staged(staged)


def test_the_helper_thread_prepares_while_the_main_thread_runs_the_forwards(
        executor: NativeExecutor) -> None:
    """With a HostHelper, parsing, encoding and staging run on its thread, every forward on
    the calling (main) thread, and the outcomes are those of the plain path, group by group."""
    ok = [c for c in CASES if "error" not in c][:6]
    bodies: list[object] = [*(_body(c) for c in ok[:3]), b"not json",
                            *(_body(c) for c in ok[3:])]
    policy = BatchPolicy(max_batch_tokens=1 << 30, max_sequences=2)
    plain = PerCaseLimits(executor)
    expected = list(answer_groups(plain, bodies, policy))
    recorder = ThreadRecorder(executor)
    helper = HostHelper()
    try:
        got = list(answer_groups(recorder, bodies, policy, helper))
    finally:
        helper.close()
    main = threading.current_thread().name
    assert recorder.threads["answer"] == {main}
    assert len(recorder.threads["prepare"]) == 1 and main not in recorder.threads["prepare"]
    assert recorder.threads["stage"] == recorder.threads["prepare"]
    assert recorder.forwards == plain.forwards == [2, 2, 2]
    assert [[p for p, _ in g] for g in got] == [[p for p, _ in g] for g in expected]
    for group, reference in zip(got, expected, strict=True):
        for (_, outcome), (_, solo) in zip(group, reference, strict=True):
            if solo.error is not None:
                assert type(outcome.error) is type(solo.error)
            else:
                assert_same_response(outcome.value.body, solo.value.body)


def test_a_generator_left_early_stops_the_helper(executor: NativeExecutor) -> None:
    """The serve loop may stop reading groups (a broken device): the helper thread must not
    stay blocked handing over the next one."""
    ok = [c for c in CASES if "error" not in c][:5]
    helper = HostHelper()
    try:
        groups = answer_groups(PerCaseLimits(executor), [_body(c) for c in ok],
                               BatchPolicy(max_batch_tokens=1 << 30, max_sequences=1), helper)
        first = next(groups)
        groups.close()
        assert [p for p, _ in first] == [0]
        # the helper is free again: another read is served
        again = list(answer_groups(PerCaseLimits(executor), [_body(ok[0])], BIG, helper))
        assert [[p for p, _ in g] for g in again] == [[0]]
    finally:
        helper.close()

"""The worker's start-up self-check (clef_worker.starting.self_check), on CPU.

Workers are started in-process through `clef_worker.main.start` (the function the worker's
`main` calls), so a test can inject a fault into one serving path with pytest's monkeypatch:
the fault exists only inside the test, nothing in the shipped code can switch it on. The fault
is an off-by-one row of the packed forward's hidden states (what a wrong offset does). Every
worker here runs the production defaults but for the setting its test is about (the fault, the
`--self-check` mode, the layout).

Also: the fallback order computed from the serving path (the CUDA branch's too, which a CPU
can only reach through its logic, plus `--cuda-graphs on`, whose shapes run eagerly on CPU), the
comparison's tie rule, and the `ready` frame's strict decoding of the verdict.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchlib.golden import answered, assert_response_matches
from clef_protocol import messages
from clef_protocol.errors import ProtocolError
from clef_protocol.options import RequestLimits, worker_argv
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import StartupError
from clef_worker.main import parse_args
from clef_worker.model.backbone import Backbone
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner
from clef_worker.serving.staging import RowResult
from clef_worker.starting import self_check
from tests.worker_start import start_worker

FP32_BOUND = 1e-4
# Golden cases at the worker's default --max-length (one golden case is cut to 420 tokens).
CASES = [case for case in answered() if case["max_length"] == 16384]


@pytest.fixture
def packed_off_by_one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every packed forward's hidden states shifted by one row (eager packed rows and graph
    buckets alike: on CPU a bucket runs the same packed forward)."""
    real = Backbone.packed_hidden_state

    def shifted(self: Backbone, input_ids: torch.Tensor, layout: Any) -> torch.Tensor:
        return torch.roll(real(self, input_ids, layout), shifts=1, dims=0)

    monkeypatch.setattr(Backbone, "packed_hidden_state", shifted)
    yield


def assert_golden_answers(executor: NativeExecutor) -> None:
    """Every golden case right, alone and all together in one group of the serving layout."""
    bodies = [json.dumps(case["request"]).encode() for case in CASES]
    together = executor.answer_prepared([executor.prepare(body) for body in bodies])
    for case, body, answer in zip(CASES, bodies, together, strict=True):
        assert_response_matches(json.loads(answer.body), case["response"])
        assert_response_matches(json.loads(executor.answer(body).body), case["response"])


def self_check_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name == "clef_worker.starting.self_check" and record.levelno == logging.ERROR]


# -- workers started in-process --------------------------------------------------------------


def test_the_default_passes_on_the_demo_snapshot() -> None:
    """Production defaults (self-check on), the built-in demo snapshot: the per-group layout
    agrees with the eager answers, and `ready` says so."""
    executor, frame = start_worker("demo")
    assert executor is not None and frame["kind"] == messages.READY
    verdict = messages.ReadyInfo.from_message(frame).self_check
    assert verdict is not None
    assert (verdict.passed, verdict.layout, verdict.fell_back_from) == (True, "per-group", [])
    assert verdict.checked >= 7 and verdict.max_abs_diff <= FP32_BOUND
    assert frame["batch_layout"] == "per-group"


def test_a_faulty_packed_path_falls_back_to_padded_with_right_answers(
        tiny_snapshot: Path, packed_off_by_one: None, caplog: pytest.LogCaptureFixture) -> None:
    """Default layout (per-group, which packs mixed groups) with the packed forward broken: an
    ERROR with the figures, a fallback to padded that re-checks and passes, `ready` says so,
    and every golden answer is right, alone and batched."""
    caplog.set_level(logging.INFO)
    executor, frame = start_worker(tiny_snapshot)
    assert executor is not None and frame["kind"] == messages.READY
    [error] = self_check_errors(caplog)
    assert "the per-group path differs" in error and "falling back to padded" in error
    assert "bound 0.0001" in error and "argmax mismatches" in error
    assert frame["self_check"]["fell_back_from"] == ["per-group"]
    assert frame["self_check"]["layout"] == "padded" and frame["self_check"]["passed"] is True
    assert frame["self_check"]["max_abs_diff"] <= FP32_BOUND
    assert frame["batch_layout"] == "padded"
    assert executor.runner.layout == "padded" and executor.policy.layout == "padded"
    assert_golden_answers(executor)


def test_an_explicit_packed_layout_falls_back_the_same_way(
        tiny_snapshot: Path, packed_off_by_one: None, caplog: pytest.LogCaptureFixture) -> None:
    executor, frame = start_worker(tiny_snapshot, "--batch-layout", "packed")
    assert executor is not None
    assert len(self_check_errors(caplog)) == 1
    assert frame["self_check"]["fell_back_from"] == ["packed"]
    assert frame["self_check"]["layout"] == "padded"
    assert_golden_answers(executor)


def test_faulty_graphs_fall_back_to_the_eager_packed_row(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The head of CUDA's chain on CPU: `--cuda-graphs on` builds the packed buckets (run
    eagerly here). A fault in the bucket replay only: the worker falls back to the eager packed
    row, drops the buckets, and `ready` lists the planned shapes with none serving."""
    real = PackedGraphRunner.run

    def shifted(self: PackedGraphRunner, ids: torch.Tensor, lengths: Any,
                bucket: int) -> torch.Tensor:
        return torch.roll(real(self, ids, lengths, bucket), shifts=1, dims=0)

    monkeypatch.setattr(PackedGraphRunner, "run", shifted)
    executor, frame = start_worker(tiny_snapshot, "--cuda-graphs", "on", "--max-length", "2048",
                                   "--graph-max-length", "512", "--max-batch-tokens", "1024")
    assert executor is not None
    [error] = self_check_errors(caplog)
    assert "the packed-graphs path differs" in error and "falling back to packed" in error
    verdict = frame["self_check"]
    assert (verdict["passed"], verdict["layout"], verdict["fell_back_from"]) == \
        (True, "packed", ["packed-graphs"])
    assert executor.runner.graphs is None and executor.runner.layout == "packed"
    assert frame["graph_shapes"] and frame["shapes"] == 0  # planned, none serving
    assert_golden_answers(executor)


def test_strict_refuses_to_start(tiny_snapshot: Path, packed_off_by_one: None) -> None:
    executor, frame = start_worker(tiny_snapshot, "--self-check", "strict")
    assert executor is None
    assert frame["kind"] == messages.FATAL
    assert "self-check failed (--self-check strict): the per-group path differs" \
        in frame["reason"]


def test_off_skips_it(tiny_snapshot: Path, packed_off_by_one: None,
                      caplog: pytest.LogCaptureFixture) -> None:
    """With the check off nothing compares: the (faulty) default layout is served as it is."""
    executor, frame = start_worker(tiny_snapshot, "--self-check", "off")
    assert executor is not None and frame["kind"] == messages.READY
    assert frame["self_check"] is None
    assert messages.ReadyInfo.from_message(frame).self_check is None
    assert self_check_errors(caplog) == []
    assert executor.runner.layout == "per-group"


def test_the_probe_requests(tiny_snapshot: Path) -> None:
    """Mixed lengths in one forward, three of one length in another (each kept whole by the
    serve loop's cutting at the CPU defaults); with graphs, a few short requests for the
    largest bucket (tests/test_self_check_largest.py runs them there)."""
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    mixed, uniform = self_check.probe_groups(executor)
    assert len({encoding.length for encoding in mixed}) == len(mixed) == 4
    assert len(uniform) == 3 and len({encoding.length for encoding in uniform}) == 1
    assert len({tuple(encoding.input_ids) for encoding in [*mixed, *uniform]}) == 7
    for group in (mixed, uniform):
        lengths = [encoding.length for encoding in group]
        assert self_check.cut(executor, lengths) == [[*range(len(group))]]
    bucketed = assemble_snapshot(tiny_snapshot, device="cpu", cuda_graphs="on", media="off",
                                 limits=RequestLimits(max_length=2048), graph_max_length=512,
                                 max_batch_tokens=1024)
    bucketed.warm_up()  # builds the buckets (eagerly on CPU)
    *_, last = self_check.probe_groups(bucketed)
    largest = max(bucketed.runner.graphs.describe()["buckets"])  # type: ignore[union-attr]
    assert self_check.largest_shape(bucketed) == (1, largest)
    assert len(last) > 1 and sum(encoding.length for encoding in last) <= largest


def test_clef_serve_and_clef_batch_pass_the_mode_to_their_workers() -> None:
    """A worker model flag: both tools hand it to the worker command line, default `on`."""
    from clef_frontend.cli import build_parser as serve_parser
    from clef_tools.batch import build_parser as batch_parser

    for parser, required in ((serve_parser(), []),
                             (batch_parser(), ["--input", "i", "--output", "o"])):
        for mode in ("on", "strict", "report", "off"):
            argv = worker_argv(parser.parse_args([*required, "--self-check", mode]))
            assert parse_args(argv).self_check == mode
        assert parse_args(worker_argv(parser.parse_args(required))).self_check == "on"


# -- the logic, without a model ---------------------------------------------------------------


@pytest.mark.parametrize(("start", "chain"), [
    ("packed-graphs", ["packed", "padded", "one-at-a-time"]),  # CUDA's default
    ("packed", ["padded", "one-at-a-time"]),
    ("per-group", ["padded", "one-at-a-time"]),  # CPU's default
    ("padded-graphs", ["padded", "one-at-a-time"]),  # CUDA where packed cannot be captured
    ("padded", ["one-at-a-time"]),
    ("one-at-a-time", []),
])
def test_fallback_chain(start: str, chain: list[str]) -> None:
    assert self_check.fallback_chain(start) == chain


def test_fallback_chain_refuses_an_unknown_path() -> None:
    with pytest.raises(ValueError, match="unknown serving path"):
        self_check.fallback_chain("diagonal")


@pytest.mark.parametrize(("layout", "graphs", "sequences", "path"), [
    ("packed", True, 16, "packed-graphs"),
    ("padded", True, 16, "padded-graphs"),
    ("packed", False, 16, "packed"),
    ("per-group", False, 8, "per-group"),
    ("padded", False, 1, "one-at-a-time"),
    ("packed", True, 1, "packed-graphs"),  # a lone request still replays a bucket
])
def test_serving_path(layout: str, graphs: bool, sequences: int, path: str) -> None:
    assert self_check.serving_path(layout, graphs, sequences) == path


def _row(*probabilities: float) -> RowResult:
    return RowResult(logits=list(probabilities), probabilities=list(probabilities), batch_size=1)


def test_compare_reports_the_largest_difference_and_argmax_flips() -> None:
    from clef_worker.model.encoding import EncodedQuestion, Encoding

    def encoding(*options: int) -> Encoding:
        questions = tuple(EncodedQuestion(id=f"q{i}", type="choice", type_id=0,
                                          question_span=(0, 1),
                                          option_ids=tuple(f"o{k}" for k in range(count)),
                                          option_spans=tuple((1, 2) for _ in range(count)))
                          for i, count in enumerate(options))
        return Encoding(input_ids=[1, 2, 3], questions=questions, state_tokens=0)

    encodings = [encoding(2), encoding(2, 3)]
    reference = [_row(0.7, 0.3), _row(0.5, 0.5, 0.2, 0.3, 0.5)]
    same = self_check.compare(reference, reference, encodings, FP32_BOUND)
    assert (same.max_abs_diff, same.argmax_mismatches) == (0.0, 0)
    assert same.agrees(FP32_BOUND)
    # A flip of a tie within the bound is not a mismatch; a real flip is.
    served = [_row(0.7, 0.3), _row(0.49995, 0.50005, 0.2, 0.3, 0.5)]
    tied = self_check.compare(served, reference, encodings, FP32_BOUND)
    assert tied.argmax_mismatches == 0 and tied.agrees(FP32_BOUND)
    served = [_row(0.3, 0.7), _row(0.5, 0.5, 0.2, 0.3, 0.5)]
    flipped = self_check.compare(served, reference, encodings, FP32_BOUND)
    assert flipped.argmax_mismatches == 1 and flipped.worst == 0
    assert flipped.max_abs_diff == pytest.approx(0.4)
    assert not flipped.agrees(FP32_BOUND)
    nan = self_check.compare([_row(float("nan"), 0.3), reference[1]], reference, encodings,
                             FP32_BOUND)
    assert nan.max_abs_diff == 1.0 and not nan.agrees(FP32_BOUND)


# -- the verdict in the ready frame -----------------------------------------------------------


def _ready(**fields: Any) -> dict[str, Any]:
    return {"kind": "ready", "model": "m", "variant": "clef-flash", "device": "cpu",
            "dtype": "float32", "gdn_path": "torch", "pid": 1, "thread": "MainThread",
            "warmup_ms": 1.0, **fields}


def test_ready_round_trips_the_verdict() -> None:
    verdict = messages.SelfCheck(True, "padded", 7, 2.5e-7, ["per-group"])
    info = messages.ReadyInfo.from_message(_ready(self_check=dataclasses.asdict(verdict)))
    assert info.self_check == verdict
    frame = messages.ready(info)
    assert messages.ReadyInfo.from_message(frame).self_check == verdict
    assert messages.ReadyInfo.from_message(_ready()).self_check is None  # an older worker
    full = messages.SelfCheck(True, "packed-graphs", 13, 3e-3, [], mode="on", bound=1e-2,
                              max_hidden_diff=2e-2, ms=812.5, reused=True,
                              probes=[{"name": "small", "passed": True, "groups": [3e-3]}])
    info = messages.ReadyInfo.from_message(_ready(self_check=dataclasses.asdict(full)))
    assert info.self_check == full


@pytest.mark.parametrize("bad", [
    {"passed": "yes", "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": []},
    {"passed": True, "layout": "packed", "checked": True, "max_abs_diff": 0.0,
     "fell_back_from": []},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": -1.0,
     "fell_back_from": []},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": "packed"},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": [], "extra": 1},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": [], "reused": "yes"},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": [], "ms": -1.0},
    {"passed": True, "layout": "packed", "checked": 7, "max_abs_diff": 0.0,
     "fell_back_from": [], "probes": ["small"]},
    [True, "packed", 7, 0.0, []],
])
def test_ready_refuses_a_malformed_verdict(bad: Any) -> None:
    with pytest.raises(ProtocolError, match="self_check"):
        messages.ReadyInfo.from_message(_ready(self_check=bad))


# -- report mode, the small probe, the hidden state -------------------------------------------


def _probe(frame: dict, name: str) -> dict:
    [probe] = [probe for probe in frame["self_check"]["probes"] if probe["name"] == name]
    return probe


def test_report_records_a_mismatch_and_keeps_the_layout(
        tiny_snapshot: Path, packed_off_by_one: None, caplog: pytest.LogCaptureFixture) -> None:
    """`--self-check report` (the GPU sitting's): the faulty layout is compared and recorded,
    never swapped for a slower one, so the benchmark measures the layout it asked for."""
    executor, frame = start_worker(tiny_snapshot, "--self-check", "report")
    assert executor is not None and frame["kind"] == messages.READY
    mismatch, failed = self_check_errors(caplog)
    assert "the per-group path differs" in mismatch and "not falling back" in mismatch
    assert "self-check failed on per-group (--self-check report)" in failed
    verdict = messages.ReadyInfo.from_message(frame).self_check
    assert verdict is not None
    assert (verdict.passed, verdict.layout, verdict.fell_back_from, verdict.mode) == \
        (False, "per-group", [], "report")
    assert verdict.max_abs_diff > FP32_BOUND and verdict.ms > 0 and not verdict.reused
    # The prefix probe's group runs through the prefixed forward, which the packed fault does
    # not touch: it is recorded as passing.
    assert {probe["name"]: probe["passed"] for probe in verdict.probes} == \
        {"groups": False, "small": False, "prefix": True}
    assert executor.runner.layout == "per-group" and frame["batch_layout"] == "per-group"


def test_report_passes_the_default_and_records_every_probe(tiny_snapshot: Path) -> None:
    """A sound layout in report mode: passed, each probe's figures and per-forward
    differences recorded, the hidden states compared token by token (float32: tiny)."""
    executor, frame = start_worker(tiny_snapshot, "--self-check", "report")
    assert executor is not None
    verdict = frame["self_check"]
    assert verdict["passed"] is True and verdict["bound"] == FP32_BOUND
    assert 0 <= verdict["max_hidden_diff"] < 1e-4
    for name in ("groups", "small"):
        probe = _probe(frame, name)
        assert probe["passed"] and probe["error"] == ""
        assert len(probe["groups"]) >= 2 and max(probe["groups"]) <= FP32_BOUND
        assert probe["max_hidden_diff"] is not None and probe["max_hidden_diff"] < 1e-4
    assert verdict["checked"] == sum(probe["checked"] for probe in verdict["probes"])


def test_the_small_probe_replays_the_370_token_bucket_with_three_mixes(
        tiny_snapshot: Path) -> None:
    """With graph buckets (run eagerly on CPU): a lone ~370-token request and two pairs of
    other lengths all land in one bucket, run back to back; then the shortest pair."""
    bucketed = assemble_snapshot(tiny_snapshot, device="cpu", cuda_graphs="on", media="off",
                                 limits=RequestLimits(max_length=2048), graph_max_length=512,
                                 max_batch_tokens=1024)
    bucketed.warm_up()  # builds the buckets (eagerly on CPU)
    lone, first, second, shortest = self_check.small_groups(bucketed)
    assert [encoding.length for encoding in lone] == [self_check.SMALL_LENGTH]
    assert [e.length for e in first] != [e.length for e in second]
    shapes = [self_check.shape_of(bucketed, [e.length for e in group])
              for group in (lone, first, second)]
    assert shapes[0] is not None and shapes[0] == shapes[1] == shapes[2]
    assert shortest[0].length == shortest[1].length <= min(e.length for e in first)
    assert len({tuple(e.input_ids) for group in (lone, first, second, shortest)
                for e in group}) == 7
    eager = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    assert len(self_check.small_groups(eager)) == 3  # no lone request: it is the reference


def test_a_bucket_that_replays_stale_inputs_is_caught(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A bucket that keeps answering with its first replay's hidden states (a graph whose
    inputs are never copied in after its capture, which warm-up replays): every later mix in
    that bucket disagrees, and the small probe, which replays the 370-token bucket with three
    mixes, says so."""
    real = PackedGraphRunner.run
    first: dict[int, torch.Tensor] = {}

    def stale(self: PackedGraphRunner, ids: torch.Tensor, lengths: Any,
              bucket: int) -> torch.Tensor:
        out = real(self, ids, lengths, bucket)
        return first.setdefault(bucket, out.clone())

    monkeypatch.setattr(PackedGraphRunner, "run", stale)
    executor, frame = start_worker(tiny_snapshot, "--cuda-graphs", "on", "--max-length", "2048",
                                   "--graph-max-length", "512", "--max-batch-tokens", "1024",
                                   "--self-check", "report")
    assert executor is not None
    small = _probe(frame, "small")
    assert small["replayed_same_shape"] is True and small["passed"] is False
    assert min(small["groups"][:3]) > FP32_BOUND  # each mix in the bucket got stale numbers
    assert frame["self_check"]["passed"] is False


def test_hidden_difference() -> None:
    reference = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert self_check.hidden_difference(reference, reference) == 0.0
    off = torch.tensor([[3.0, 4.5], [1.0, 0.0]])
    assert self_check.hidden_difference(off, reference) == pytest.approx(0.1)
    assert math.isnan(self_check.hidden_difference(torch.full((2, 2), float("nan")),
                                                   reference))
    assert math.isnan(self_check.hidden_difference(reference[:1], reference))


def test_a_probe_plugs_in_and_its_remedy_runs(tiny_snapshot: Path) -> None:
    """An extra probe is a function and a `Probe` entry: its result travels in the verdict;
    a disagreeing non-layout probe gets its remedy under `on`, and the layout stays."""
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    executor.warm_up()
    remedied: list[str] = []

    def wrong(context: self_check.Context) -> self_check.ProbeResult:
        return self_check.ProbeResult("extra", 1, 0.5, extra={"what": "a cache"})

    def remedy(target: Any, result: self_check.ProbeResult) -> str:
        remedied.append(result.name)
        return "turned the cache off"

    probes = (*self_check.LAYOUT_PROBES,
              self_check.Probe("extra", wrong, layout=False, remedy=remedy))
    verdict = self_check.run_self_check(executor, "on", probes)
    assert verdict is not None and remedied == ["extra"]
    assert verdict.passed and verdict.layout == "per-group" and verdict.fell_back_from == []
    [extra] = [probe for probe in verdict.probes if probe["name"] == "extra"]
    assert extra["passed"] is False and extra["remedy"] == "turned the cache off"
    assert extra["what"] == "a cache"
    with pytest.raises(StartupError, match="the extra probe differs"):
        self_check.run_self_check(executor, "strict", probes)
    bare = (*self_check.LAYOUT_PROBES, self_check.Probe("extra", wrong, layout=False))
    failed = self_check.run_self_check(executor, "on", bare)
    assert failed is not None and not failed.passed and failed.layout == "per-group"

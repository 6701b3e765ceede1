"""Prefix-cache groups through the packed buckets (`--cuda-graphs on` on CPU: the same code a
CUDA replay records, run eagerly): a group with a hit, a store and a plain member takes the
graphed path (counted, and the eager prefixed forward is never called); every answer equals
the cache-off answer within float32's golden bound; what the buckets' forward records passes
the no-sync guard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchlib.golden import PROBABILITY_TOLERANCE
from benchlib.paths import FINETUNE_FIXTURES
from clef_protocol.finetune import resolve_finetunes
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.prefix_forward import Captured
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu import packed_graphs
from clef_worker.serving.gpu.capture import EagerCapturer
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner
from clef_worker.serving.gpu.sync_guard import NoSyncMode, SyncError, guarded
from clef_worker.serving.prefix import run as prefix_run
from clef_worker.serving.prefix.cache import (
    CacheKey,
    Hit,
    PrefixCache,
    default_store_policy,
    root_key,
)
from clef_worker.serving.prefix.graphed import Member, batches
from clef_worker.serving.runner import ModelRunner
from tests.prefix_helpers import agent_loop, events, uncached_probabilities

BOUND = PROBABILITY_TOLERANCE
QUESTIONS = {"decide": {"type": "choice", "criteria": {"a": "approve", "b": "block"}}}
OTHER = {"risky": {"type": "noul"}, "level": {"type": "score", "criteria": ["low", "high"]}}


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    built = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", cuda_graphs="on",
                              batch_layout="packed", graph_max_length=1024)
    graphs = built.runner.graphs
    assert isinstance(graphs, PackedGraphRunner) and not graphs.graphs
    graphs.build_all()
    return built


def _request(state: Any, questions: dict[str, Any], model: str = "clef-flash") -> bytes:
    return json.dumps({"model": model, "state": state, "questions": questions}).encode()




@pytest.fixture
def no_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager prefixed forward must not run."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the eager prefixed forward ran")

    monkeypatch.setattr(prefix_run, "prefixed_forward", refuse)


def test_a_group_with_a_hit_a_store_and_a_plain_member_replays_the_buckets(
        executor: NativeExecutor, no_eager: None) -> None:
    runner = executor.runner
    cache, graphs = runner.prefix_cache, runner.graphs
    assert cache is not None and cache.enabled and isinstance(graphs, PackedGraphRunner)
    cache.clear()
    executor.answer_prepared([executor.prepare(_request(events(16), QUESTIONS))])
    assert cache.blocks  # the warm request stored its points through the buckets
    group = [executor.prepare(_request(events(16), OTHER)),  # a hit
             executor.prepare(_request(events(14, "x"), QUESTIONS)),  # stores
             executor.prepare(_request(events(2, "y"), OTHER))]  # plain: a short state
    before, paths = graphs.stats.state_replays, runner.prefix_paths.copy()
    output = runner.run_staged(executor.stage(group)[1])
    assert [row.reused_tokens > 0 for row in output.rows] == [True, False, False]
    assert runner.prefix_paths - paths == {"graphed": 1}
    assert graphs.stats.state_replays > before
    for prepared, row in zip(group, output.rows, strict=True):
        want = uncached_probabilities(executor, prepared)
        assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND
    # The storing member's blocks are found again, and reused through the buckets too.
    again = executor.prepare(_request(events(14, "x"), OTHER))
    [row] = runner.run_staged(executor.stage([again])[1]).rows
    assert row.reused_tokens > 0
    want = uncached_probabilities(executor, again)
    assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND


def test_a_hit_behind_a_member_of_any_length_reads_its_own_cached_keys(
        executor: NativeExecutor, no_eager: None) -> None:
    """The buckets' rows are dense: a member's keys sit in the key buffers right after the one
    before it, whatever that one's length (not at a 64-token boundary), so a hit in a later
    slot attends to its own cached keys."""
    runner = executor.runner
    cache, graphs = runner.prefix_cache, runner.graphs
    assert cache is not None and isinstance(graphs, PackedGraphRunner)
    cache.clear()
    executor.answer_prepared([executor.prepare(_request(events(16), QUESTIONS))])
    group = [executor.prepare(_request(events(3, "z"), OTHER)),  # plain, short
             executor.prepare(_request(events(16), OTHER))]  # a hit
    assert len(group[0].encoding.input_ids) % 64  # its segment ends off a chunk boundary
    paths = runner.prefix_paths.copy()
    output = runner.run_staged(executor.stage(group)[1])
    assert [row.reused_tokens > 0 for row in output.rows] == [False, True]
    assert runner.prefix_paths - paths == {"graphed": 1}
    for prepared, row in zip(group, output.rows, strict=True):
        want = uncached_probabilities(executor, prepared)
        assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND


def test_an_agent_loop_reuses_each_turn_through_the_buckets(
        executor: NativeExecutor, no_eager: None) -> None:
    reused, _ = agent_loop(executor, QUESTIONS, 1e-4 + BOUND)
    assert reused[0] == 0 and 0 < reused[1] < reused[2]


def test_what_the_buckets_record_never_syncs(executor: NativeExecutor,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The stateful forward every bucket captures, under the no-sync guard, for a group with
    a hit, a store and a plain member."""
    mode = NoSyncMode()
    monkeypatch.setattr(packed_graphs, "stateful_forward",
                        guarded(packed_graphs.stateful_forward, mode))
    cache = executor.runner.prefix_cache
    assert cache is not None
    cache.clear()
    executor.answer_prepared([executor.prepare(_request(events(16), QUESTIONS))])
    group = [executor.prepare(_request(events(16), OTHER)),
             executor.prepare(_request(events(14, "z"), QUESTIONS)),
             executor.prepare(_request(events(2, "w"), OTHER))]
    executor.runner.run_staged(executor.stage(group)[1])
    assert mode.operations > 0


def test_the_guard_refuses_syncs_and_data_sized_ops() -> None:
    values = torch.tensor([0.0, 1.0, 2.0])
    for bad in (lambda: values.sum().item(), lambda: values.nonzero(),
                lambda: values.masked_select(values > 0), lambda: torch.unique(values),
                lambda: bool(values[1])):
        with pytest.raises(SyncError), NoSyncMode():
            bad()
    with NoSyncMode() as mode:
        (values * 2).index_select(0, torch.tensor([2, 0]))
    assert mode.operations >= 2


def test_members_split_where_a_round_would_overflow(executor: NativeExecutor) -> None:
    graphs = executor.runner.graphs
    assert isinstance(graphs, PackedGraphRunner) and graphs.states is not None
    largest = max(graphs.static)
    members = [Member(i, Hit([]), length, ()) for i, length in
               enumerate([largest // 2, largest // 2, 64, largest])]
    sizes = [[m.index for m in batch] for batch in batches(graphs, members)]
    assert sizes == [[0, 1], [2], [3]]
    assert np.all([len(batch) <= graphs.max_sequences for batch in sizes])


def test_cuda_stores_only_the_state_end_of_long_enough_states() -> None:
    cpu = PrefixCache(1 << 20, block_tokens=256, policy=default_store_policy("cpu"))
    cuda = PrefixCache(1 << 20, block_tokens=2048, policy=default_store_policy("cuda:0"))
    assert cpu.points(0, 700) == (256, 512, 640)
    assert cuda.points(0, 7000) == (6976,)
    assert cuda.points(0, 900) == ()  # a short state: cheaper to recompute than to keep
    assert cuda.points(4096, 7000) == (6976,)


def test_a_grown_state_supersedes_its_older_point() -> None:
    """With end-only storing (CUDA's), the point a request continued from gives up its
    recurrent state once the request stores a later one; lookups pass through it."""
    cache = PrefixCache(1 << 30, block_tokens=2048, policy=default_store_policy("cuda:0"))
    root = root_key("")
    ids = np.arange(4000, dtype=np.int64)

    def store(state_end: int) -> Hit:
        key = CacheKey(root, state_end)
        hit = cache.lookup(key, ids)
        points = cache.points(hit.tokens, state_end)
        captured = Captured(points, [[torch.ones(2, 4, 4)] for _ in points],
                            [[torch.ones(3, 8)] for _ in points],
                            [torch.ones(1, state_end - hit.tokens, 4)],
                            [torch.ones(1, state_end - hit.tokens, 4)], [0] * len(points))
        cache.store(key, ids, hit, captured, torch.ones(state_end - hit.tokens, 8))
        return hit

    store(1100)
    before = cache.bytes
    assert store(2100).tokens == 1024  # the first turn's point reused
    first, second = sorted(cache.blocks.values(), key=lambda block: block.end)
    assert first.recurrent == [] and second.recurrent
    assert cache.bytes < before + second.nbytes + 1  # the first point's state was freed
    hit = cache.lookup(CacheKey(root, 3000), ids)
    assert [block.end for block in hit.chain] == [1024, 2048]
    # Ending inside the superseded block is no hit at all.
    assert cache.lookup(CacheKey(root, 1100), ids[:1100]).tokens == 0


def test_buckets_fall_back_to_the_plain_forward_if_the_stateful_one_fails(
        executor: NativeExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker still starts, and answers, when the forward with state inputs cannot run:
    the buckets are built without them and prefix-cache groups take the eager path."""

    def broken(*_: Any, **__: Any) -> None:
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(packed_graphs, "stateful_forward", broken)
    graphs = PackedGraphRunner(executor.backbone, (512, 1024), 4, executor.pad_id,
                               EagerCapturer())
    assert graphs.build_all() == [1024, 512]
    assert graphs.states is None
    cache = PrefixCache(1 << 30)
    runner = ModelRunner(executor.backbone, executor.head, executor.pad_id, graphs=graphs,
                         layout="packed", prefix_cache=cache)
    prepared = executor.prepare(_request(events(16), QUESTIONS))
    staged = runner.stage([prepared.encoding],
                          cache_keys=[executor.prefix_key(prepared.encoding)])
    [row] = runner.run_staged(staged).rows
    assert runner.prefix_paths == {"eager": 1} and cache.blocks
    want = uncached_probabilities(executor, prepared)
    assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND


def test_a_variant_continues_its_own_prefix_through_the_buckets(
        tiny_snapshot: Path, no_eager: None) -> None:
    """The buckets' per-position variant slots are written for each round's layout."""
    built = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", cuda_graphs="on",
                              batch_layout="packed", graph_max_length=1024,
                              finetunes=tuple(resolve_finetunes([str(FINETUNE_FIXTURES)])))
    graphs = built.runner.graphs
    assert isinstance(graphs, PackedGraphRunner) and graphs.selection is not None
    graphs.build_all()
    first = built.prepare(_request(events(16), QUESTIONS, model="tiny-alpha"))
    assert first.slot != 0
    built.answer_prepared([first])
    group = [built.prepare(_request(events(16), OTHER, model="tiny-alpha")),
             built.prepare(_request(events(16), OTHER))]  # the base: its own (no) prefix
    output = built.runner.run_staged(built.stage(group)[1])
    assert [row.reused_tokens > 0 for row in output.rows] == [True, False]
    assert built.runner.prefix_paths["graphed"] >= 2
    for prepared, row in zip(group, output.rows, strict=True):
        want = uncached_probabilities(built, prepared)
        assert max(abs(a - b) for a, b in zip(row.probabilities, want, strict=True)) <= BOUND


def test_a_stack_without_attention_layers_stores_and_reuses_through_the_buckets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two Gated DeltaNet layers and no attention layer (the benchmarks' small shape cut to two
    layers): a round then has no keys to place in the key buffers, and the warm-up's
    store-then-reuse through the buckets must still run (it raised IndexError)."""
    import importlib

    from benchlib.flash_model import LOADER_MODULE, InMemoryModel
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot
    from clef_worker.demo import ensure_demo_snapshot

    model = InMemoryModel("small", layers=2)
    loader = importlib.import_module(LOADER_MODULE)
    monkeypatch.setattr(loader, "load_backbone", model.load_backbone)
    monkeypatch.setattr(loader, "load_head", model.load_head)
    executor = assemble_snapshot(
        ensure_demo_snapshot(), variant="clef-flash", device="cpu", dtype="float32",
        gdn_prefill="auto", short_conv="auto", limits=RequestLimits(max_length=1024),
        demo=True, media="off", cuda_graphs="on", max_batch_tokens=2048)
    assert model.parameters  # the in-memory stack, not the demo snapshot's
    executor.warm_up()  # stores a prefix, then reuses it, through the packed buckets
    assert executor.runner.prefix_paths["graphed"] >= 1

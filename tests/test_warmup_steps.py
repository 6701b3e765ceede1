"""The warm-up's steps do what start-up needs once and nothing nobody reads
(clef_worker.starting.warmup.warm_native): the prefixed forward's kernels compiled during the
warm-up
(a stored prefix, then a hit), the cache left empty; packed buckets not replayed (their replay
times are read by nothing), padded shapes still are (the padded plan compares them). CPU
executors at the defaults but for the setting each test is about."""

from __future__ import annotations

from pathlib import Path

from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot


def test_the_warm_up_runs_a_prefix_hit_and_leaves_the_cache_empty(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    cache = executor.runner.prefix_cache
    assert cache is not None and cache.enabled and cache.hits == 0
    executor.warm_up()
    assert cache.hits >= 1 and cache.tokens_reused > 0  # the reusing forward ran
    assert not cache.blocks and cache.bytes == 0  # and nobody's blocks are kept


def test_no_prefix_warm_up_without_the_cache(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off", prefix_cache="off")
    cache = executor.runner.prefix_cache
    executor.warm_up()
    assert cache is None or cache.lookups == 0


def test_packed_buckets_are_not_replayed_after_capture(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off", cuda_graphs="on",
                                 batch_layout="packed", limits=RequestLimits(max_length=600),
                                 max_batch_tokens=512)
    graphs = executor.runner.graphs
    assert graphs is not None
    executor.warm_up()
    assert graphs.stats.built and graphs.costs_ms == {}

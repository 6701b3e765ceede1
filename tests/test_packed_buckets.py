"""The packed graphs' bucket table (clef_worker.serving.gpu.buckets.cost_bucket_lengths), spaced by
what padding costs in time under the fixed-plus-per-token replay model, and the dense static
row every packed bucket runs (clef_worker.model.packed, `align=1`): its shapes never change with
the mix, so one graph per bucket replays any group."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from clef_worker.model.packed import FLA_CHUNK, StaticPackedLayout
from clef_worker.serving.gpu.buckets import (
    DEFAULT_COST_RATIO,
    DEFAULT_FIXED_TOKENS,
    DEFAULT_STEP,
    BucketTable,
    bucket_lengths,
    cost_bucket_lengths,
)
from clef_worker.serving.gpu.packed_graphs import aligned_offsets, aligned_total, packed_buckets

CPU = torch.device("cpu")


# -- the packed graphs' table, spaced by what padding costs in time ---------------------------


def test_the_cost_spaced_table_at_the_h200_defaults() -> None:
    lengths = cost_bucket_lengths(16384)
    assert lengths[:5] == (64, 128, 192, 320, 448)  # fixed cost dominates: 64 then 128 apart
    assert lengths[-1] == 16384 and len(lengths) == 29
    assert all(length % 64 == 0 for length in lengths)
    assert list(lengths) == sorted(set(lengths))


@given(st.integers(1, 1 << 15))
def test_every_cost_spaced_step_stays_within_its_share_of_a_replay(max_length: int) -> None:
    """A forward padded to the next bucket costs at most `ratio` (plus one 64-token rounding)
    more than one of its own length, under the fixed-plus-per-token model."""
    lengths = cost_bucket_lengths(max_length)
    assert lengths[-1] == max_length and list(lengths) == sorted(set(lengths))
    for low, high in itertools.pairwise(lengths[:-1]):  # the last step ends at the budget
        step = high - low
        assert step == DEFAULT_STEP or step <= (
            DEFAULT_COST_RATIO * (DEFAULT_FIXED_TOKENS + low) + DEFAULT_STEP)


def test_cost_spacing_wastes_less_time_than_the_token_table_for_as_many_shapes() -> None:
    """Over every length up to the budget, the modelled time a forward spends on padding."""
    def mean_overhead(lengths: tuple[int, ...]) -> float:
        table = BucketTable(lengths)
        total = 0.0
        for n in range(1, 16385):
            bucket = table.select(n)
            assert bucket is not None
            total += (DEFAULT_FIXED_TOKENS + bucket) / (DEFAULT_FIXED_TOKENS + n) - 1
        return total / 16384

    cost, tokens = cost_bucket_lengths(16384), bucket_lengths(16384)
    assert len(cost) <= len(tokens) + 1
    assert mean_overhead(cost) < 0.75 * mean_overhead(tokens)


def test_cost_spacing_refuses_bad_parameters() -> None:
    with pytest.raises(ValueError):
        cost_bucket_lengths(0)
    with pytest.raises(ValueError):
        cost_bucket_lengths(1024, ratio=0.0)



# -- the dense static row ---------------------------------------------------------------------


@given(st.lists(st.integers(1, 700), min_size=1, max_size=8), st.integers(0, 3))
def test_dense_static_shapes_never_change_with_the_mix(lengths: list[int], spare: int) -> None:
    total = -(-sum(lengths) // FLA_CHUNK) * FLA_CHUNK + FLA_CHUNK * spare
    static = StaticPackedLayout(total_tokens=total, max_sequences=8, device=CPU, align=1)
    shapes = (static.cu_seqlens.shape, static.chunk_indices.shape, static.positions.shape)
    assert shapes[0] == (8 + 3,) and shapes[1] == (total // FLA_CHUNK + 8, 2)
    layout = static.fill(lengths)
    assert (layout.cu_seqlens.shape, layout.chunk_indices.shape, layout.positions.shape) == shapes
    offsets = layout.cu_seqlens_host
    assert list(offsets[:len(lengths)]) == aligned_offsets(lengths)  # back to back
    assert offsets[-2:] == (total, total)  # the last slot is always empty
    pairs = layout.chunk_indices.tolist()
    real = [[s, c] for s, (a, b) in enumerate(itertools.pairwise(offsets))
            for c in range(-(-(b - a) // FLA_CHUNK))]
    assert pairs[:len(real)] == real
    assert pairs[len(real):] == [[8 + 1, 0]] * (len(pairs) - len(real))
    positions = layout.positions.tolist()
    for (start, _), length in zip(layout.spans(), lengths, strict=False):
        assert positions[start:start + length] == list(range(length))


def test_a_dense_row_costs_its_own_tokens_and_fits_the_largest_bucket() -> None:
    assert aligned_total([393] * 16) == 6288
    assert aligned_total([393] * 16, align=FLA_CHUNK) == 7168  # the chunk-aligned row
    buckets = packed_buckets(16384, 16384)
    assert min(b for b in buckets if b >= 6288) < 7168
    with pytest.raises(ValueError, match="multiple"):
        StaticPackedLayout(total_tokens=100, max_sequences=2, device=CPU, align=1)
    with pytest.raises(ValueError, match="align"):
        StaticPackedLayout(total_tokens=256, max_sequences=2, device=CPU, align=2)

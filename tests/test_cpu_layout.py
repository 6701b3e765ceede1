"""CPU's `--batch-layout auto`: each group padded when its lengths are uniform enough that
padding wastes little, else packed (clef_worker.serving.policy.group_layout, the one place that
decides; the measurements behind the threshold are in docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchlib.bodies import mixed_length_bodies, uniform_length_bodies
from benchlib.golden import PROBABILITY_TOLERANCE
from clef_protocol.body import parse_body
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.native import NativeExecutor
from clef_worker.serving.policy import (
    MAX_PADDED_WASTE,
    PACKED,
    PADDED,
    PER_GROUP,
    BatchPolicy,
    group_layout,
    padding_waste,
)


def test_auto_is_per_group_on_cpu_and_packed_on_cuda() -> None:
    assert BatchPolicy.resolve("cpu").layout == PER_GROUP
    assert BatchPolicy.resolve("cuda:1").layout == PACKED
    assert BatchPolicy.resolve("cpu", layout="packed").layout == PACKED


def test_padding_waste() -> None:
    assert padding_waste([500] * 8) == 0.0
    assert padding_waste([100, 300]) == pytest.approx(1 / 3)
    assert padding_waste([]) == 0.0


@pytest.mark.parametrize(("lengths", "layout"), [
    ([480] * 8, PADDED),  # uniform: nothing to waste
    ([500, 480, 470, 490], PADDED),  # within a few percent
    ([126, 1553, 400, 900], PACKED),  # the mixed bench's spread
    ([1000, 1000, 1000, 100], PACKED),  # one short request among long ones wastes 22 %
])
def test_group_layout_per_group(lengths: list[int], layout: str) -> None:
    assert group_layout(PER_GROUP, lengths) == layout
    assert (padding_waste(lengths) <= MAX_PADDED_WASTE) == (layout == PADDED)


@pytest.mark.parametrize("fixed", [PACKED, PADDED])
def test_a_fixed_layout_is_kept_for_every_group(fixed: str) -> None:
    assert group_layout(fixed, [126, 1553]) == fixed
    assert group_layout(fixed, [500, 500]) == fixed


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    """CPU defaults (`auto`), the tiny snapshot."""
    return assemble_snapshot(tiny_snapshot, device="cpu", limits=RequestLimits(max_length=2048))


def test_the_default_cpu_executor_pads_uniform_groups_and_packs_mixed_ones(
        executor: NativeExecutor) -> None:
    """Each group in the layout its lengths call for, its cost against the budget counted in
    that layout, and every answer equal to the same request alone."""
    assert executor.policy.layout == PER_GROUP and executor.runner.graphs is None
    for bodies, packed in ((uniform_length_bodies(4, 500), False),
                           (mixed_length_bodies(4, 1200), True)):
        encodings = [executor.encode(parse_body(body)) for body in bodies]
        lengths = [encoding.length for encoding in encodings]
        staged = executor.runner.stage(encodings)
        assert staged.packed is packed, lengths
        expected = sum(lengths) if packed else len(lengths) * max(lengths)
        assert executor.batch_tokens(lengths) == expected
        together = executor.runner.run_staged(staged).rows
        for encoding, row in zip(encodings, together, strict=True):
            [alone] = executor.runner.run([encoding]).rows
            assert row.batch_size == len(encodings)
            assert max(abs(a - b) for a, b in zip(row.probabilities, alone.probabilities,
                                                  strict=True)) <= PROBABILITY_TOLERANCE


def test_bucketed_shapes_keep_cpu_auto_packed(tiny_snapshot: Path) -> None:
    """`--cuda-graphs on` on CPU builds one layout's shapes: auto is packed there, as before."""
    bucketed = assemble_snapshot(tiny_snapshot, device="cpu", cuda_graphs="on",
                                 limits=RequestLimits(max_length=1024), graph_max_length=512,
                                 max_batch_tokens=1024, media="off")
    assert bucketed.policy.layout == PACKED and bucketed.runner.layout == PACKED
    assert bucketed.runner.graphs is not None

"""The packed CUDA branch with fla's real kernels, no GPU: fla-core's varlen gated delta rule and
short convolution run on CPU under Triton's interpreter, called the way the packed layers call
them (the project's `kernels_for`, `PackedLayout`/`StaticPackedLayout` and their
`chunk_indices`, fla's memo switched off), against the per-sequence torch path.

The kernels run in a process of their own (`tests/fla_interpreter.py`: the harness and the
measurement), because `TRITON_INTERPRET=1` must be set before fla is first imported. Bound: the
float32 golden bound scaled down to what the two paths' float32 arithmetic allows (different
chunkings of the same recurrence: about 1e-7 measured), 1e-5.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from benchlib.triton_interpreter import harness_result
from tests.fla_interpreter import MIXES, STATIC_SEQUENCES, STATIC_TOKENS

BOUND = 1e-5
FLA_CHUNK = 64


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    return harness_result("tests.fla_interpreter")


def expected_chunk_indices(offsets: list[int]) -> list[list[int]]:
    """fla's (sequence, chunk within it) pairs for these offsets, written out plainly."""
    pairs = []
    for sequence, (start, end) in enumerate(itertools.pairwise(offsets)):
        pairs += [[sequence, chunk] for chunk in range(-(-(end - start) // FLA_CHUNK))]
    return pairs


def test_the_fla_path_is_the_one_measured(measured: dict[str, Any]) -> None:
    assert measured["interpreter"] == "1"
    # fla's delta rule and convolution (attention has no CPU varlen kernel: not measured here)
    assert measured["names"][:2] == ["fla-varlen", "fla-varlen"]
    assert measured["memo_off"] is True  # kernels_for switched fla's index memo off
    assert measured["fused"] == "fla"  # and chose fla's fused norms, rotary and gates
    assert [case["lengths"] for case in measured["cases"]] == [list(m) for m in MIXES]


def test_the_layouts_hand_fla_its_own_chunk_indices(measured: dict[str, Any]) -> None:
    packed, *statics = measured["cases"]
    assert packed["offsets"] == [0, 70, 71, 128]
    assert packed["chunk_indices"] == expected_chunk_indices(packed["offsets"])
    # the static row: aligned sequences, the tail, empty slots; one chunk per 64 tokens
    for static in statics:
        assert static["layout"] == "static"
        assert len(static["offsets"]) == STATIC_SEQUENCES + 2
        assert static["offsets"][-1] == STATIC_TOKENS
        assert static["chunk_indices"] == expected_chunk_indices(static["offsets"])
        assert len(static["chunk_indices"]) == STATIC_TOKENS // FLA_CHUNK
    # each refill wrote other offsets into the same buffers
    assert len({tuple(static["offsets"]) for static in statics}) == len(statics) > 1


@pytest.mark.parametrize("index", range(len(MIXES)))
def test_flas_kernels_equal_the_per_sequence_torch_path(measured: dict[str, Any],
                                                         index: int) -> None:
    """Each sequence's real tokens from fla's varlen kernels equal the same sequence run alone
    through the torch path: nothing crosses a boundary, and the static row refilled in place
    for each later mix gives that mix's answers (not an earlier fill's)."""
    case = measured["cases"][index]
    assert case["finite"]
    assert case["delta_max_abs_diff"] <= BOUND, case
    assert case["conv_max_abs_diff"] <= BOUND, case


def test_the_dense_static_row_pads_flas_chunks_with_an_empty_slot(
        measured: dict[str, Any]) -> None:
    """The dense row (`align=1`, what the packed graphs run): sequences back to back, the
    tail, and always one empty slot at the end; the chunk pairs are fla's for those offsets,
    then pairs of the empty slot up to the fixed capacity (a chunk per 64 tokens plus one per
    request)."""
    capacity = STATIC_TOKENS // FLA_CHUNK + STATIC_SEQUENCES
    for case, lengths in zip(measured["dense"], MIXES, strict=True):
        offsets = case["offsets"]
        assert len(offsets) == STATIC_SEQUENCES + 3 and offsets[-2:] == [STATIC_TOKENS] * 2
        assert offsets[:len(lengths) + 1] == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        real = expected_chunk_indices(offsets)
        assert case["chunk_indices"][:len(real)] == real
        spare = case["chunk_indices"][len(real):]
        assert len(real) + len(spare) == capacity
        assert spare == [[STATIC_SEQUENCES + 1, 0]] * len(spare)


@pytest.mark.parametrize("index", range(len(MIXES)))
def test_flas_kernels_on_the_dense_static_row_equal_the_per_sequence_torch_path(
        measured: dict[str, Any], index: int) -> None:
    """Unaligned sequences and spare chunk pairs change nothing at any real token."""
    case = measured["dense"][index]
    assert case["finite"]
    assert case["delta_max_abs_diff"] <= BOUND, case
    assert case["conv_max_abs_diff"] <= BOUND, case

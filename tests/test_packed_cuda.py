"""Packed rows with the real CUDA kernels (for bench/gpu_session.sh): fla's varlen delta rule and
short convolution and `varlen_attn` against separate forwards, a boundary that leaks nothing, a
forward that never syncs with the host, and one CUDA graph of a static row replayed for other
mixes of lengths.

Skipped without CUDA or fla-core. Written before any GPU was available: it has not run yet.
On the tiny reference snapshot in bfloat16 (GQA 2:1, two key heads serving four value heads):
it loads in a second, so the GPU sitting runs these first among its optional steps.
tests/test_packed_forward.py covers the same code on CPU with fakes for fla and varlen_attn, and
tests/test_packed_fla_interpreter.py runs fla's real kernels on CPU under Triton's interpreter.

bfloat16 bounds: the packed and the separate forwards run different kernels (varlen against
fixed-shape fla, FlashAttention varlen against SDPA), so they agree to bfloat16 rounding through
the layers; each token's row is compared by its relative norm (5 %), which a leak across a
boundary (the previous sequence's convolution taps or recurrent state, or wrong rotary
positions) exceeds by far. Where the same kernels see the same values (the boundary test, a
replay against its eager forward) the rows are expected to be exactly equal.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.backbone import Backbone
from clef_worker.model.packed import PackedLayout, StaticPackedLayout
from clef_worker.serving.gpu.capture import prepare_capture_environment
from tests.ci_policy import requires_cuda

# fla-core is in the test extra, so only the GPU may be missing (the one skip CI allows).
pytestmark = [requires_cuda(),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                                 reason="fla-core is not installed (the test extra installs it)")]

DEVICE = torch.device("cuda")
ROW_BOUND = 0.05  # relative norm error of one token's row, bfloat16 (see the module docs)


@pytest.fixture(scope="module")
def backbone(tiny_snapshot: Path) -> Backbone:
    """The tiny reference snapshot in bfloat16 on the fla path."""
    prepare_capture_environment()  # before fla is imported: no FlashQLA (it reads the host)
    executor = assemble_snapshot(tiny_snapshot, device="cuda", dtype="bfloat16",
                                   cuda_graphs="off", limits=RequestLimits(max_length=2048))
    assert executor.backbone.gdn_path == "fla"
    return executor.backbone


def random_ids(lengths: Sequence[int], seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # within the tiny snapshot's 640-token vocabulary, below its special tokens
    return [torch.randint(0, 520, (n,), generator=generator).to(DEVICE) for n in lengths]


def separate(backbone: Backbone, sequences: Sequence[Tensor]) -> list[Tensor]:
    with torch.inference_mode():
        return [backbone.last_hidden_state(ids.unsqueeze(0))[0].float() for ids in sequences]


def packed(backbone: Backbone, sequences: Sequence[Tensor]) -> tuple[Tensor, PackedLayout]:
    layout = PackedLayout.from_lengths([len(ids) for ids in sequences], DEVICE)
    with torch.inference_mode():
        return backbone.packed_hidden_state(torch.cat(list(sequences)), layout).float(), layout


def assert_rows_close(hidden: Tensor, layout: PackedLayout, expected: Sequence[Tensor]) -> None:
    for index, ((start, _), reference) in enumerate(zip(layout.spans(), expected, strict=False)):
        rows = hidden[start:start + len(reference)].float()
        error = ((rows - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-6)).max()
        assert error.item() <= ROW_BOUND, f"sequence {index}: row error {error.item():.3f}"


def test_cuda_packed_forward_runs_the_varlen_kernels_and_equals_separate_forwards(
        backbone: Backbone) -> None:
    sequences = random_ids([40, 200, 7, 130, 700], seed=1)
    hidden, layout = packed(backbone, sequences)
    assert backbone.packed_kernels is not None
    assert backbone.packed_kernels.names == ("fla-varlen", "fla-varlen", "varlen_attn")
    assert backbone.packed_kernels.graph_safe
    assert_rows_close(hidden, layout, separate(backbone, sequences))


def test_cuda_a_boundary_leaks_nothing(backbone: Backbone) -> None:
    sequences = random_ids([150, 90, 300], seed=2)
    changed = [torch.flip(sequences[0], (0,)), *sequences[1:]]
    before, layout = packed(backbone, sequences)
    after, _ = packed(backbone, changed)
    rest = slice(layout.spans()[1][0], None)
    first = slice(*layout.spans()[0])
    assert not torch.equal(before[first], after[first])
    # Deterministic kernels on the same shapes: the later rows' numbers cannot move.
    assert torch.equal(before[rest], after[rest]), (before[rest] - after[rest]).abs().max()


def test_cuda_packed_forward_never_syncs_with_the_host(backbone: Backbone) -> None:
    sequences = random_ids([64, 333, 5], seed=3)
    layout = PackedLayout.from_lengths([len(ids) for ids in sequences], DEVICE)
    ids = torch.cat(sequences)
    with torch.inference_mode():
        backbone.packed_hidden_state(ids, layout)  # autotuning (which syncs) happens here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backbone.packed_hidden_state(ids, layout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def fill_ids(static: StaticPackedLayout, layout: PackedLayout, ids: Tensor,
             sequences: Sequence[Tensor]) -> None:
    ids.zero_()
    for (start, _), sequence in zip(layout.spans(), sequences, strict=False):
        ids[start:start + len(sequence)] = sequence


def test_cuda_one_graph_per_static_row_replays_any_mix(backbone: Backbone) -> None:
    static = StaticPackedLayout(total_tokens=1024, max_sequences=4, device=DEVICE)
    ids = torch.zeros(static.total_tokens, dtype=torch.int64, device=DEVICE)
    warm = random_ids([300, 5, 64], seed=4)
    fill_ids(static, static.fill([len(s) for s in warm]), ids, warm)

    def forward() -> Tensor:
        return backbone.packed_hidden_state(ids, static.layout())

    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = forward()
        for lengths, seed in (([511, 200], 5), ([7, 64, 65, 700], 6), ([1000], 7)):
            sequences = random_ids(lengths, seed)
            layout = static.fill(lengths)
            fill_ids(static, layout, ids, sequences)
            graph.replay()
            replayed = output.float().clone()
            eager = forward().float()
            assert_rows_close(replayed, layout, [eager[start:start + n] for (start, _), n
                                                 in zip(layout.spans(), lengths, strict=False)])
            assert_rows_close(replayed, layout, separate(backbone, sequences))

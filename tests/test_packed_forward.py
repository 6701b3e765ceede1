"""Packed rows (clef_worker.model.packed, packed_layers): a packed forward equals separate
forwards of its sequences, nothing crosses a boundary, the chunk-aligned static layout equals the
unaligned one, and the CUDA branch builds the arguments fla and varlen_attn expect (with fakes
standing in for them: no GPU here).

Float32 on CPU, tiny fixture. Bounds: the golden bound (1e-4) for packed against separate
forwards (different kernels for the short convolution and different matrix shapes, so float
noise, measured about 1e-5); exact equality where the same kernels run on the same values (the
boundary test)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn import functional as F

from benchlib.golden import LOGIT_TOLERANCE, answered
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model import packed_kernels, short_conv, swap
from clef_worker.model.backbone import Backbone
from clef_worker.model.gated_delta import chunked_gated_delta_rule
from clef_worker.model.packed import (
    FLA_CHUNK,
    PackedLayout,
    StaticPackedLayout,
)
from clef_worker.model.packed_kernels import (
    LOOPED,
    PackedKernels,
    fla_kernels,
    kernels_for,
)
from clef_worker.model.packed_layers import packed_forward

CPU = torch.device("cpu")
GOLDEN_IDS = [case["input_ids"] for case in answered()]


@pytest.fixture(scope="module")
def backbone(tiny_snapshot: Path) -> Backbone:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                   limits=RequestLimits(max_length=4096))
    return executor.backbone


def random_ids(lengths: Sequence[int], seed: int, vocab: int = 600) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator) for n in lengths]


def separate(backbone: Backbone, sequences: Sequence[Tensor]) -> list[Tensor]:
    with torch.inference_mode():
        return [backbone.last_hidden_state(ids.unsqueeze(0))[0] for ids in sequences]


def packed(backbone: Backbone, sequences: Sequence[Tensor],
           kernels: PackedKernels | None = None) -> tuple[Tensor, PackedLayout]:
    layout = PackedLayout.from_lengths([len(ids) for ids in sequences], CPU)
    ids = torch.cat(list(sequences))
    with torch.inference_mode():
        if kernels is None:
            return backbone.packed_hidden_state(ids, layout), layout
        return packed_forward(backbone.model, ids, layout, kernels), layout


def assert_rows_match(hidden: Tensor, layout: PackedLayout, expected: Sequence[Tensor],
                      bound: float = LOGIT_TOLERANCE) -> None:
    for index, ((start, _), reference) in enumerate(zip(layout.spans(), expected, strict=False)):
        rows = hidden[start:start + len(reference)]
        error = (rows - reference).abs().max().item()
        assert error <= bound, f"sequence {index} ({len(reference)} tokens): {error:.2e}"


# -- layouts ----------------------------------------------------------------------------------


def fla_chunk_indices(offsets: Sequence[int], chunk: int = FLA_CHUNK) -> list[list[int]]:
    """fla's `prepare_chunk_indices` as its source computes it (segment ids and running index
    of each sequence's ceil(len / chunk) chunks, with repeat_interleave)."""
    lengths = torch.tensor(offsets).diff()
    counts = (lengths + chunk - 1) // chunk
    segment = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = F.pad(counts.cumsum(0), (1, 0))[:-1]
    within = torch.arange(len(segment)) - starts[segment]
    return torch.stack([segment, within], 1).tolist()


def test_a_layout_holds_offsets_positions_and_flas_chunk_indices() -> None:
    layout = PackedLayout.from_lengths([3, 64, 65, 1], CPU)
    assert layout.cu_seqlens_host == (0, 3, 67, 132, 133)
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.cu_seqlens.tolist() == [0, 3, 67, 132, 133]
    assert layout.positions.dtype == torch.int64
    assert layout.positions.tolist() == [*range(3), *range(64), *range(65), 0]
    assert layout.chunk_indices.dtype == torch.int32
    assert layout.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0]]
    assert layout.chunk_indices.tolist() == fla_chunk_indices(layout.cu_seqlens_host)
    assert layout.max_seqlen == 65 and layout.total_tokens == 133 and layout.num_sequences == 4


@pytest.mark.parametrize("lengths", [[], [5, 0]])
def test_a_layout_refuses_empty_rows_and_empty_sequences(lengths: list[int]) -> None:
    with pytest.raises(ValueError, match="at least one"):
        PackedLayout.from_lengths(lengths, CPU)


@given(st.lists(st.integers(1, 700), min_size=1, max_size=8))
def test_static_shapes_never_change_with_the_mix(lengths: list[int]) -> None:
    aligned = sum(-(-n // 64) * 64 for n in lengths)
    static = StaticPackedLayout(total_tokens=-(-aligned // 128) * 128 + 128, max_sequences=8,
                                device=CPU)
    shapes = (static.cu_seqlens.shape, static.chunk_indices.shape, static.positions.shape)
    layout = static.fill(lengths)
    assert (layout.cu_seqlens.shape, layout.chunk_indices.shape, layout.positions.shape) == shapes
    offsets = layout.cu_seqlens_host
    assert layout.cu_seqlens.tolist() == list(offsets)
    assert len(offsets) == 8 + 2 and offsets[-1] == static.total_tokens
    assert all(offset % 64 == 0 for offset in offsets)
    assert all(end - start >= n for (start, end), n in zip(layout.spans(), lengths, strict=False))
    assert layout.chunk_indices.tolist() == fla_chunk_indices(offsets)
    assert len(layout.chunk_indices) == static.total_tokens // FLA_CHUNK
    assert layout.max_seqlen == static.total_tokens


def test_static_layouts_hand_out_new_views_of_the_same_buffers() -> None:
    """fla memoises index helpers by tensor identity: each forward must get a new object over
    the same memory (what a captured graph reads)."""
    static = StaticPackedLayout(total_tokens=256, max_sequences=4, device=CPU)
    first = static.fill([10, 70])
    second = static.fill([200])
    assert first.cu_seqlens is not second.cu_seqlens
    buffer = static.cu_seqlens.data_ptr()
    assert first.cu_seqlens.data_ptr() == second.cu_seqlens.data_ptr() == buffer
    assert first.chunk_indices.data_ptr() == second.chunk_indices.data_ptr()
    assert first.positions.data_ptr() == second.positions.data_ptr()
    assert second.cu_seqlens.tolist() == [0, 256, 256, 256, 256, 256]  # one sequence, empty tail
    assert first.cu_seqlens.tolist() == [0, 256, 256, 256, 256, 256]  # a view: rewritten in place


def test_static_layouts_refuse_what_does_not_fit() -> None:
    static = StaticPackedLayout(total_tokens=256, max_sequences=2, device=CPU)
    with pytest.raises(ValueError, match="do not fit"):
        static.fill([1, 1, 1])
    with pytest.raises(ValueError, match="more than"):
        static.fill([200, 1])  # 256 + 64 aligned tokens
    with pytest.raises(ValueError, match="multiple"):
        StaticPackedLayout(total_tokens=100, max_sequences=2, device=CPU)
    with pytest.raises(ValueError, match="align"):
        StaticPackedLayout(total_tokens=256, max_sequences=2, device=CPU, align=32)


# -- packed equals separate -------------------------------------------------------------------


def golden_groups() -> list[list[int]]:
    """Every golden case exactly once, in groups of mixed sizes and lengths."""
    order = list(range(len(GOLDEN_IDS)))
    order = order[::2] + order[1::2]
    sizes = itertools.cycle([4, 1, 6, 3, 5])
    groups, start = [], 0
    while start < len(order):
        size = next(sizes)
        groups.append(order[start:start + size])
        start += size
    return groups


@pytest.mark.parametrize("group", golden_groups(), ids=lambda g: "-".join(map(str, g)))
def test_every_golden_case_packed_in_a_mixed_group_equals_its_separate_forward(
        backbone: Backbone, group: list[int]) -> None:
    sequences = [torch.tensor(GOLDEN_IDS[index]) for index in group]
    hidden, layout = packed(backbone, sequences)
    assert hidden.shape == (sum(len(ids) for ids in sequences), backbone.hidden_size)
    assert_rows_match(hidden, layout, separate(backbone, sequences))


def test_a_boundary_leaks_nothing(backbone: Backbone) -> None:
    """Changing sequence 0 changes no number of the sequences after it. Exact: the projections
    compute each row from its own inputs, and every sequence-mixing kernel runs on the later
    sequences' values alone."""
    sequences = random_ids([200, 130, 70], seed=1)
    changed = [torch.flip(sequences[0], (0,)) + 1, *sequences[1:]]
    before, layout = packed(backbone, sequences)
    after, _ = packed(backbone, changed)
    first = slice(*layout.spans()[0])
    assert not torch.equal(before[first], after[first])
    rest = slice(layout.spans()[1][0], None)
    assert torch.equal(before[rest], after[rest])
    # The check can fail: the same tokens as one sequence do carry sequence 0 into the others.
    joined, _ = packed(backbone, [torch.cat(changed)])
    assert (joined[rest] - after[rest]).abs().max().item() > 1e-3


def test_the_chunk_aligned_static_layout_equals_the_unaligned_layout(backbone: Backbone) -> None:
    sequences = [torch.tensor(GOLDEN_IDS[index]) for index in (9, 1, 10, 5)]
    unaligned, layout = packed(backbone, sequences)
    static = StaticPackedLayout(total_tokens=2560, max_sequences=6, device=CPU)
    aligned_layout = static.fill([len(ids) for ids in sequences])
    ids = torch.full((static.total_tokens,), 524, dtype=torch.int64)  # the fixture's pad id
    for (start, _), sequence in zip(aligned_layout.spans(), sequences, strict=False):
        ids[start:start + len(sequence)] = sequence
    with torch.inference_mode():
        aligned = backbone.packed_hidden_state(ids, aligned_layout)
    expected = [unaligned[start:end] for start, end in layout.spans()]
    assert_rows_match(aligned, aligned_layout, expected)
    assert_rows_match(aligned, aligned_layout, separate(backbone, sequences))


@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=8), seed=st.integers(0, 99))
def test_random_length_mixes_equal_separate_forwards(backbone: Backbone, lengths: list[int],
                                                     seed: int) -> None:
    sequences = random_ids(lengths, seed)
    hidden, layout = packed(backbone, sequences)
    assert_rows_match(hidden, layout, separate(backbone, sequences))


@pytest.mark.parametrize("lengths", [[1, 2, 3, 4], [70, 1, 129], [5]])
def test_the_masked_convolution_equals_one_convolution_per_sequence(
        backbone: Backbone, lengths: list[int]) -> None:
    """The graph-safe torch convolution (fla path with --short-conv torch) restarts at every
    boundary, as transformers' function run on each sequence alone does."""
    generator = torch.Generator().manual_seed(len(lengths))
    x = torch.randn(1, sum(lengths), 24, generator=generator)
    weight = torch.randn(24, 4, generator=generator)
    layout = PackedLayout.from_lengths(lengths, CPU)
    got = packed_kernels.masked_conv(x, weight, None, "silu", layout)
    expected = packed_kernels.looped_conv(x, weight, None, "silu", layout)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lengths", [[1, 2, 3, 4], [70, 1, 129]])
def test_the_masked_convolution_reads_each_sequences_tail(
        backbone: Backbone, lengths: list[int]) -> None:
    """With state inputs (a continued prefix), a tap before a sequence's first token reads its
    tail row, as the per-sequence convolution over tail-then-rows does; the tails change the
    answer, so equal answers show they were read at the right rows."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1, sum(lengths), 24, generator=generator)
    weight = torch.randn(24, 4, generator=generator)
    layout = PackedLayout.from_lengths(lengths, CPU)
    tail = torch.randn(len(lengths), 3, 24, generator=generator)
    got = packed_kernels.masked_conv(x, weight, None, "silu", layout, tail)
    expected = packed_kernels.looped_conv(x, weight, None, "silu", layout, tail)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    fresh = packed_kernels.masked_conv(x, weight, None, "silu", layout, torch.zeros_like(tail))
    torch.testing.assert_close(fresh, packed_kernels.masked_conv(x, weight, None, "silu",
                                                                 layout), rtol=0, atol=1e-6)
    assert (got - fresh).abs().max() > 1e-2


def test_the_cpu_backbone_runs_the_per_sequence_kernels(backbone: Backbone) -> None:
    packed(backbone, random_ids([5], seed=0))
    assert backbone.packed_kernels is LOOPED
    assert not LOOPED.graph_safe


def test_input_ids_must_match_the_layout(backbone: Backbone) -> None:
    layout = PackedLayout.from_lengths([4, 4], CPU)
    with pytest.raises(ValueError, match=r"\[8\]"):
        backbone.packed_hidden_state(torch.zeros(7, dtype=torch.int64), layout)


# -- the CUDA branch, with fakes for fla and varlen_attn ---------------------------------------


class Calls:
    """What the fakes were called with; each fake checks its arguments as the real kernel
    documents them and computes the real kernel's answer from the *device* offsets only."""

    def __init__(self) -> None:
        self.delta: list[dict[str, Any]] = []
        self.conv: list[dict[str, Any]] = []
        self.attention: list[dict[str, Any]] = []


def device_spans(cu_seqlens: Tensor) -> list[tuple[int, int]]:
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1
    return list(itertools.pairwise(cu_seqlens.tolist()))


def check_chunk_indices(chunk_indices: Tensor, cu_seqlens: Tensor) -> None:
    assert chunk_indices.dtype == torch.int32 and chunk_indices.shape[1] == 2
    assert chunk_indices.tolist() == fla_chunk_indices(cu_seqlens.tolist())


def fake_fla(calls: Calls) -> tuple[Any, Any, Any]:
    def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               scale: float | None = None, initial_state: Tensor | None = None,
                               output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: Tensor | None = None,
                               cu_seqlens_cpu: Tensor | None = None,
                               chunk_indices: Tensor | None = None,
                               **kwargs: Any) -> tuple[Tensor, None]:
        calls.delta.append({"cu_seqlens_cpu": cu_seqlens_cpu, "l2norm": use_qk_l2norm_in_kernel,
                            "initial_state": initial_state, "shape": tuple(q.shape)})
        assert q.shape[0] == 1 and cu_seqlens is not None and chunk_indices is not None
        check_chunk_indices(chunk_indices, cu_seqlens)
        outputs = []
        for start, end in device_spans(cu_seqlens):
            if end > start:
                part = slice(start, end)
                out, _ = chunked_gated_delta_rule(q[:, part], k[:, part], v[:, part], g[:, part],
                                                  beta[:, part], use_qk_l2norm_in_kernel=True)
                outputs.append(out)
        return torch.cat(outputs, 1), None

    def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                      residual: Tensor | None = None, initial_state: Tensor | None = None,
                      output_final_state: bool | None = False, activation: str | None = None,
                      backend: str | None = "triton", cu_seqlens: Tensor | None = None,
                      cu_seqlens_cpu: Tensor | None = None, chunk_indices: Tensor | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
        calls.conv.append({"backend": backend, "activation": activation,
                           "cu_seqlens_cpu": cu_seqlens_cpu, "shape": tuple(x.shape)})
        assert x.shape[0] == 1 and x.shape[2] == weight.shape[0] and initial_state is None
        assert cu_seqlens is not None and chunk_indices is not None
        check_chunk_indices(chunk_indices, cu_seqlens)
        width = weight.shape[1]
        outputs = []
        for start, end in device_spans(cu_seqlens):
            if end > start:
                part = x[:, start:end].transpose(1, 2)
                out = F.conv1d(part, weight.unsqueeze(1), bias, padding=width - 1,
                               groups=weight.shape[0])[..., :end - start]
                outputs.append(F.silu(out).transpose(1, 2))
        return torch.cat(outputs, 1), None

    def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                    cu_seq_k: Tensor | None, max_q: int, max_k: int, *,
                    scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                    enable_gqa: bool = False, **kwargs: Any) -> Tensor:
        calls.attention.append({"window": window_size, "max": (max_q, max_k),
                                "gqa": enable_gqa, "shape": tuple(query.shape)})
        assert query.dim() == 3 and cu_seq_k is cu_seq_q and window_size == (-1, 0)
        assert all(x.is_contiguous() for x in (query, key, value))
        return causal_per_sequence(query, key, value, cu_seq_q, max_q, max_k, scale,
                                   enable_gqa)

    return chunk_gated_delta_rule, causal_conv1d, varlen_attn


def causal_per_sequence(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor,
                        max_q: int, max_k: int, scale: float | None, gqa: bool) -> Tensor:
    """What FlashAttention's varlen causal forward computes, from the device offsets."""
    spans = device_spans(cu_seqlens)
    assert max(end - start for start, end in spans) <= max_q == max_k
    assert gqa or query.shape[1] == key.shape[1]
    outputs = []
    for start, end in spans:
        if end > start:
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
            outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs, 0)


def poisoned(layout: PackedLayout) -> PackedLayout:
    """The layout with wrong host offsets (the total kept): a path that reads them breaks."""
    host = layout.cu_seqlens_host
    wrong = (0, *(min(host[-1], offset + 1) for offset in host[1:-1]), host[-1])
    return dataclasses.replace(layout, cu_seqlens_host=wrong)


def test_the_fla_branch_reads_offsets_from_the_device_only(backbone: Backbone) -> None:
    calls = Calls()
    kernels = fla_kernels(*fake_fla(calls))
    assert kernels.graph_safe
    assert kernels.names == ("fla-varlen", "fla-varlen", "varlen_attn")
    sequences = random_ids([70, 1, 129, 64], seed=3)
    layout = PackedLayout.from_lengths([len(ids) for ids in sequences], CPU)
    with torch.inference_mode():
        hidden = packed_forward(backbone.model, torch.cat(sequences), poisoned(layout), kernels)
    assert_rows_match(hidden, layout, separate(backbone, sequences))
    config: Any = backbone.model.config
    linear = config.layer_types.count("linear_attention")
    assert len(calls.delta) == len(calls.conv) == linear
    assert len(calls.attention) == config.num_hidden_layers - linear
    assert all(c["cu_seqlens_cpu"] is None and c["l2norm"] and c["initial_state"] is None
               for c in calls.delta)
    assert {c["backend"] for c in calls.conv} == {"triton"}
    assert {c["activation"] for c in calls.conv} == {config.hidden_act}
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert {c["gqa"] for c in calls.attention} == {heads[0] != heads[1]}
    assert {c["shape"] for c in calls.attention} == {(264, heads[0], config.head_dim)}
    assert {c["max"] for c in calls.attention} == {(129, 129)}


def test_one_static_row_replays_any_mix_on_the_fla_branch(backbone: Backbone) -> None:
    """The buffers a graph would read, refilled for two different mixes: each forward equals
    the separate forwards, with the same shapes everywhere (one graph per bucket)."""
    calls = Calls()
    kernels = fla_kernels(*fake_fla(calls))
    static = StaticPackedLayout(total_tokens=640, max_sequences=4, device=CPU)
    for lengths, seed in (([300, 5, 64], 4), ([511], 5)):
        sequences = random_ids(lengths, seed)
        layout = static.fill(lengths)
        ids = torch.zeros(static.total_tokens, dtype=torch.int64)
        for (start, _), sequence in zip(layout.spans(), sequences, strict=False):
            ids[start:start + len(sequence)] = sequence
        with torch.inference_mode():
            hidden = packed_forward(backbone.model, ids, poisoned(layout), kernels)
        assert_rows_match(hidden, layout, separate(backbone, sequences))
    assert {c["shape"][1] for c in calls.delta} == {640}
    assert {c["max"] for c in calls.attention} == {(640, 640)}


def test_torch_2_10s_varlen_attn_gets_is_causal_and_repeated_key_heads(
        backbone: Backbone) -> None:
    """torch 2.10's varlen_attn had `is_causal` and neither `scale` nor `enable_gqa`."""
    seen: list[tuple[int, int]] = []

    def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                    cu_seq_k: Tensor, max_q: int, max_k: int, *, is_causal: bool = False,
                    return_aux: Any = None) -> Tensor:
        assert is_causal
        seen.append((query.shape[1], key.shape[1]))
        return causal_per_sequence(query, key, value, cu_seq_q, max_q, max_k, None, False)

    delta, conv, _ = fake_fla(Calls())
    sequences = random_ids([33, 90], seed=6)
    hidden, layout = packed(backbone, sequences, fla_kernels(delta, conv, varlen_attn))
    assert_rows_match(hidden, layout, separate(backbone, sequences))
    config: Any = backbone.model.config
    assert config.num_attention_heads > config.num_key_value_heads  # the repeat was exercised
    assert set(seen) == {(config.num_attention_heads, config.num_attention_heads)}


def test_an_fla_without_chunk_indices_gets_host_offsets_and_is_not_graph_safe(
        backbone: Backbone) -> None:
    seen: list[Any] = []

    def old_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       scale: float | None = None, initial_state: Tensor | None = None,
                       output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                       cu_seqlens: Tensor | None = None, cu_seqlens_cpu: Tensor | None = None,
                       **kwargs: Any) -> tuple[Tensor, None]:  # fla-core 0.5.0's signature
        seen.append((cu_seqlens_cpu, kwargs))
        output, _ = chunked_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return output, None

    kernels = fla_kernels(old_delta_rule, None, None)
    assert not kernels.graph_safe
    assert kernels.names == ("fla-varlen", "masked-torch", "per-sequence")
    packed(backbone, random_ids([9], seed=0), kernels)
    host, kwargs = seen[0]
    assert host.tolist() == [0, 9] and "chunk_indices" not in kwargs


def test_the_fla_path_picks_flas_varlen_kernels_and_varlen_attn(
        backbone: Backbone, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA with fla: fla's delta rule, fla's convolution when `--short-conv` bound it (the
    adapter is installed), varlen_attn in half precision."""
    delta, conv, _ = fake_fla(Calls())
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = delta  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    utils = types.ModuleType("fla.utils")
    utils.FLA_DISABLE_TENSOR_CACHE = False  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla.utils", utils)
    modeling = packed_kernels.modeling_module()
    cuda = torch.device("cuda")
    assert kernels_for(cuda, torch.bfloat16, "fla").names == (
        "fla-varlen", "masked-torch", "varlen_attn")  # --short-conv torch: no adapter bound
    swap.replace(modeling, short_conv.FUNCTION_NAME,
                 lambda original: short_conv.FlaShortConv(conv, original))
    try:
        kernels = kernels_for(cuda, torch.bfloat16, "fla")
        # float32 has no FlashAttention kernel: per-sequence attention, and no graphs
        in_float32 = kernels_for(cuda, torch.float32, "fla")
    finally:
        short_conv.uninstall(modeling)
    assert kernels.names == ("fla-varlen", "fla-varlen", "varlen_attn") and kernels.graph_safe
    assert in_float32.names == ("fla-varlen", "fla-varlen", "per-sequence")
    assert not in_float32.graph_safe
    assert utils.FLA_DISABLE_TENSOR_CACHE is True
    # varlen_attn's per-call INFO line stays out of the worker's log
    assert logging.getLogger(packed_kernels.VARLEN_MODULE).level == logging.WARNING
    assert kernels_for(cuda, torch.bfloat16, "torch") is LOOPED
    assert kernels_for(CPU, torch.float32, "torch") is LOOPED
    assert packed_kernels.load_varlen_attention(CPU, torch.bfloat16) is None


# -- the wider demo snapshot (GQA 4:1, key heads serving two value heads, 128-wide heads) ------


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Backbone:
    from clef_worker.demo import DemoSpec, ensure_demo_snapshot

    snapshot = ensure_demo_snapshot(tmp_path_factory.mktemp("wide"), DemoSpec.wide())
    return assemble_snapshot(snapshot, device="cpu", dtype="float32",
                               limits=RequestLimits(max_length=1024)).backbone


def test_wide_snapshot_packed_and_fla_branch_equal_separate_forwards(wide: Backbone) -> None:
    sequences = random_ids([40, 200, 7, 130], seed=7, vocab=1000)
    expected = separate(wide, sequences)
    hidden, layout = packed(wide, sequences)
    assert_rows_match(hidden, layout, expected)
    hidden, layout = packed(wide, sequences, fla_kernels(*fake_fla(Calls())))
    assert_rows_match(hidden, layout, expected)

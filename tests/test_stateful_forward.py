"""The one packed forward with state inputs (clef_worker.model.stateful) on the buckets' dense
row: with fresh states it is the plain packed forward (the tail slot and the empty slot keep zero
rows), it runs the kernel set's fused elementwise ops, and the state buffers are sized for the
dense row's sequences (the real ones, the dummy tail, the always-empty slot)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.model.backbone import Backbone
from clef_worker.model.fused import TORCH, FusedOps
from clef_worker.model.packed import StaticPackedLayout, static_sequences
from clef_worker.model.packed_kernels import LOOPED, PackedKernels
from clef_worker.model.packed_layers import packed_forward, stateful_forward
from clef_worker.serving.gpu.state_buffers import StateBuffers, StateShapes, fresh

CPU = torch.device("cpu")
TOKENS, MAX_SEQUENCES = 256, 3
LENGTHS = (100, 64, 30)  # 194 tokens back to back, a 62-token dummy tail


@pytest.fixture(scope="module")
def backbone(tiny_snapshot: Path) -> Backbone:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                                 limits=RequestLimits(max_length=4096))
    return executor.backbone


def _buffers(backbone: Backbone) -> StateBuffers:
    return StateBuffers(StateShapes.of(backbone.model), static_sequences(MAX_SEQUENCES, 1),
                        TOKENS, 2 * TOKENS, CPU, torch.float32)


def _counting(calls: Counter[str]) -> FusedOps:
    """The torch set, each op counted when called."""

    def counted(name: str) -> Any:
        op = getattr(TORCH, name)

        def call(*args: Any) -> Any:
            calls[name] += 1
            return op(*args)

        return call

    names = [f.name for f in dataclasses.fields(FusedOps) if f.name != "name"]
    return dataclasses.replace(TORCH, name="counted", **{n: counted(n) for n in names})


def test_the_state_buffers_take_the_dense_rows_tail_and_empty_slot(backbone: Backbone) -> None:
    layout = StaticPackedLayout(TOKENS, MAX_SEQUENCES, CPU, align=1).fill(LENGTHS)
    states = _buffers(backbone)
    assert layout.num_sequences == states.slots == MAX_SEQUENCES + 2
    states.fill(layout, fresh(LENGTHS))  # raised for the tail before the rows were sized by it
    aligned = StaticPackedLayout(TOKENS, MAX_SEQUENCES, CPU).fill(LENGTHS[:2])
    assert aligned.num_sequences == static_sequences(MAX_SEQUENCES, 64) == MAX_SEQUENCES + 1


def test_fresh_states_are_the_plain_packed_forward_with_the_fused_ops(
        backbone: Backbone) -> None:
    layout = StaticPackedLayout(TOKENS, MAX_SEQUENCES, CPU, align=1).fill(LENGTHS)
    states = _buffers(backbone)
    states.fill(layout, fresh(LENGTHS))
    ids = torch.randint(0, 600, (TOKENS,), generator=torch.Generator().manual_seed(3))
    plain_calls: Counter[str] = Counter()
    state_calls: Counter[str] = Counter()
    plain_kernels = dataclasses.replace(LOOPED, fused=_counting(plain_calls))
    state_kernels: PackedKernels = dataclasses.replace(LOOPED, fused=_counting(state_calls))
    with torch.inference_mode():
        plain = packed_forward(backbone.model, ids, layout, plain_kernels)
        hidden, out = stateful_forward(backbone.model, ids, layout, state_kernels,
                                       states.inputs(TOKENS))
    torch.testing.assert_close(hidden, plain, rtol=0, atol=1e-5)
    # the stateful forward runs every fused op the plain one does, as often
    assert state_calls == plain_calls and set(state_calls) == {
        "norm", "gated_norm", "rotary_table", "rotate", "decay", "mlp", "output_gate"}
    linear = StateShapes.of(backbone.model).linear_layers
    assert len(out.recurrent) == len(out.conv) == linear
    assert out.recurrent[0].shape[0] == MAX_SEQUENCES + 2
    # the real sequences' final states are non-zero; the empty slot's stays zero
    assert all(out.recurrent[0][slot].abs().max() > 0 for slot in range(len(LENGTHS)))
    assert not out.recurrent[0][-1].any()

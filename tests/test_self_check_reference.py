"""The self-check's reference runs the kernels serving compiled
(clef_worker.starting.self_check_reference).

A GPU compiles fla's Triton kernels once per form: the packed (varlen) form serving captures,
and a fixed-length form that only the old reference used. On CPU there is nothing to compile,
so these tests check the structure instead: packed kernels that stand in for fla's (plain torch,
recording every call, installed as the backbone's `packed_kernels` under fla's name) must be the
very objects the reference calls, over one sequence, while transformers' fixed-length
module-level kernels are never called by it; and a padded worker's reference calls what padded
serving calls. Workers run the production defaults but for the layout each test is about.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from clef_worker.model import gated_delta, short_conv
from clef_worker.model.packed import PackedLayout
from clef_worker.model.packed_kernels import (
    PackedKernels,
    looped_attention,
    masked_conv,
    modeling_module,
)
from clef_worker.native import NativeExecutor
from clef_worker.starting import self_check_reference
from clef_worker.starting.self_check import Context, Requests, bound_for, compare
from tests.worker_start import start_worker


class Calls:
    """Which kernel entry point ran, and over how many sequences."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def names(self) -> set[str]:
        return {name for name, _ in self.log}


def recording_kernels(calls: Calls) -> PackedKernels:
    """fla-named packed kernels in plain torch that record each call's sequence count."""

    def delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                   layout: PackedLayout, initial: Tensor | None = None
                   ) -> tuple[Tensor, Tensor | None]:
        assert initial is None  # the reference runs every request from nothing
        spans = [span for span in layout.spans() if span[1] > span[0]]
        calls.log.append(("packed-delta", len(spans)))
        return torch.cat([gated_delta.chunked_gated_delta_rule(
            query[:, a:b], key[:, a:b], value[:, a:b], g[:, a:b], beta[:, a:b],
            use_qk_l2norm_in_kernel=True)[0] for a, b in spans], dim=1), None

    def conv(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             layout: PackedLayout, tail: Tensor | None = None) -> Tensor:
        calls.log.append(("packed-conv", len([s for s in layout.spans() if s[1] > s[0]])))
        return masked_conv(x, weight, bias, activation, layout, tail)

    return PackedKernels(delta_rule=delta_rule, conv=conv, attention=looped_attention,
                         names=("fla-varlen", "fla-varlen", "per-sequence"), graph_safe=False)


def record_module_kernels(monkeypatch: pytest.MonkeyPatch, calls: Calls) -> None:
    """transformers' module-level kernels (the fixed-length form) recorded."""
    module = modeling_module()
    for name, label in ((gated_delta.KERNEL_NAME, "fixed-delta"),
                        (short_conv.FUNCTION_NAME, "fixed-conv")):
        real: Callable[..., Any] = getattr(module, name)

        def recorded(*args: Any, _real: Callable[..., Any] = real, _label: str = label,
                     **kwargs: Any) -> Any:
            calls.log.append((_label, int(args[0].shape[0])))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)


def gdn_layers(executor: NativeExecutor) -> int:
    return sum(1 for layer in executor.backbone.model.layers
               if getattr(layer, "linear_attn", None) is not None)


def test_the_reference_calls_the_packed_serving_kernels_over_one_sequence(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor, frame = start_worker(tiny_snapshot, "--batch-layout", "packed")
    assert executor is not None and frame["self_check"]["passed"] is True
    calls = Calls()
    kernels = recording_kernels(calls)
    monkeypatch.setattr(executor.backbone, "packed_kernels", kernels)
    record_module_kernels(monkeypatch, calls)
    module = modeling_module()
    before = (getattr(module, gated_delta.KERNEL_NAME), getattr(module, short_conv.FUNCTION_NAME))
    assert self_check_reference.kernel_form(executor.backbone) == self_check_reference.VARLEN
    requests = Requests(executor)
    first, second = requests.make(150), requests.make(90)

    context = Context(executor, bound_for(executor))
    references = [context.reference(first), context.reference(second)]
    layers = gdn_layers(executor)
    assert layers > 0
    # Every Gated DeltaNet layer of both references: the packed kernels, one sequence each;
    # transformers' fixed-length kernels never.
    assert calls.log.count(("packed-delta", 1)) == 2 * layers
    assert calls.log.count(("packed-conv", 1)) == 2 * layers
    assert calls.names() == {"packed-delta", "packed-conv"}
    # The swap ends with the reference.
    assert (getattr(module, gated_delta.KERNEL_NAME),
            getattr(module, short_conv.FUNCTION_NAME)) == before

    # Serving the two together: the same kernel objects, now over two sequences.
    calls.log.clear()
    served = executor.runner.run([first, second])
    assert executor.backbone.packed_kernels is kernels
    assert calls.log.count(("packed-delta", 2)) == layers
    assert calls.names() == {"packed-delta", "packed-conv"}
    comparison = compare(served.rows, [answer.row for answer in references], [first, second],
                         bound_for(executor))
    assert comparison.agrees(bound_for(executor)), comparison


def test_a_padded_worker_s_reference_runs_what_padded_serving_runs(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    executor, frame = start_worker(tiny_snapshot, "--batch-layout", "padded")
    assert executor is not None and frame["self_check"]["passed"] is True
    assert executor.backbone.packed_kernels is None  # nothing was compiled for packing
    assert self_check_reference.kernel_form(executor.backbone) == self_check_reference.FIXED
    calls = Calls()
    record_module_kernels(monkeypatch, calls)
    requests = Requests(executor)
    encoding = requests.make(120)
    Context(executor, bound_for(executor)).reference(encoding)
    reference_calls = list(calls.log)
    calls.log.clear()
    executor.runner.run([encoding, requests.make(80)])
    assert reference_calls and set(reference_calls) <= {("fixed-delta", 1), ("fixed-conv", 1)}
    assert {name for name, _ in calls.log} == {name for name, _ in reference_calls}


def test_the_one_sequence_adapters_leave_other_calls_to_the_original() -> None:
    """Batched rows or recurrent states are not what the packed kernels answer: those calls
    keep transformers' function (the prefix forward's own calls never reach the adapters,
    but nothing here may change them)."""
    calls = Calls()
    seen: list[str] = []

    def original(*args: Any, **kwargs: Any) -> Any:
        seen.append("original")
        return args[0], None

    delta = self_check_reference.one_sequence_delta_rule(recording_kernels(calls), original)
    q = torch.zeros(2, 8, 1, 4)
    g = torch.zeros(2, 8, 1)
    delta(q, q, q, g, g, use_qk_l2norm_in_kernel=True)  # two rows
    delta(q[:1], q[:1], q[:1], g[:1], g[:1], use_qk_l2norm_in_kernel=True,
          output_final_state=True)
    assert seen == ["original", "original"] and not calls.log
    output, state = delta(q[:1], q[:1], q[:1], g[:1], g[:1], use_qk_l2norm_in_kernel=True)
    assert calls.log == [("packed-delta", 1)] and state is None and output.shape == q[:1].shape

"""fla's Triton short convolution against transformers' torch one, on a GPU (bench/gpu_session.sh).

Skipped without CUDA or fla-core. At Clef-Flash's convolution width (8,192 channels, width 4,
silu, no bias) in bfloat16: the bound adapter agrees with transformers' torch function and with a
float32 reference, and it can be captured in a CUDA graph (a host sync during capture raises).
tests/test_short_conv.py covers the same adapter on CPU with a test double of the kernel.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from clef_worker.model import short_conv
from clef_worker.model.module_names import MODELING_MODULE
from tests.ci_policy import requires_cuda

# fla-core is in the test extra, so only the GPU may be missing (the one skip CI allows).
pytestmark = [requires_cuda(),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                                 reason="fla-core is not installed (the test extra installs it)")]

CHANNELS = 2 * 16 * 128 + 32 * 128  # q, k (16 heads x 128) and v (32 heads x 128): Clef-Flash
WIDTH = 4
DEVICE = torch.device("cuda")


@pytest.fixture
def bound() -> Iterator[tuple[Any, Any]]:
    """(adapter, transformers' torch function), unbound again after the test."""
    module: Any = importlib.import_module(MODELING_MODULE)
    short_conv.uninstall(module)
    reference = module.causal_conv1d_fn
    try:
        assert short_conv.bind_short_conv(DEVICE, "fla", "fla") == short_conv.FLA_PATH
        yield module.causal_conv1d_fn, reference
    finally:
        short_conv.uninstall(module)


def inputs(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, D, T] (a transposed [B, T, D] projection, as transformers passes it) and [D, W]."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(rows, length, CHANNELS, device=DEVICE, generator=generator)
    weight = torch.randn(CHANNELS, WIDTH, device=DEVICE, generator=generator) * 0.5
    return hidden.bfloat16().transpose(1, 2), weight.bfloat16()


@pytest.mark.parametrize(("rows", "length"), [(1, 370), (2, 1024)])
def test_cuda_fla_conv_matches_torch(bound: tuple[Any, Any], rows: int, length: int) -> None:
    adapter, reference = bound
    hidden, weight = inputs(rows, length, seed=length)
    with torch.inference_mode():
        got = adapter(hidden, weight, None, activation="silu")
        expected = reference(hidden, weight, None, activation="silu")
        exact = reference(hidden.float(), weight.float(), None, activation="silu")
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # fla accumulates and applies silu in float32 and rounds once: within a bf16 step or two of
    # the float32 result; torch's bf16 path rounds twice, so allow it both steps.
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_cuda_fla_conv_is_capturable(bound: tuple[Any, Any]) -> None:
    adapter, _ = bound
    hidden, weight = inputs(1, 384, seed=1)
    static = hidden.clone()
    with torch.inference_mode():
        adapter(static, weight, None, activation="silu")  # autotune and compile before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = adapter(static, weight, None, activation="silu")
        fresh, _ = inputs(1, 384, seed=2)
        static.copy_(fresh)
        graph.replay()
        eager = adapter(fresh, weight, None, activation="silu")
    torch.testing.assert_close(output, eager, rtol=0, atol=0)

"""The short-convolution binding (clef_worker.model.short_conv), on CPU.

fla's Triton kernel needs a GPU, so these tests give the adapter a kernel with fla's calling
convention (`x` as [B, T, D] in and out, a [D, W] weight, keyword arguments, a `(y,
final_state)` tuple back) whose arithmetic is transformers' own torch `causal_conv1d_fn`. The
arithmetic is therefore not this file's to define: what is tested is the adapter's layout
contract, i.e. that it hands fla the projection as [B, T, D] where it lies, and turns fla's
answer back into exactly what transformers' function returns for the same call (layout, dtype,
bias, activation). fla's real kernel is compared with transformers on a GPU in
tests/test_short_conv_cuda.py.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clef_protocol.options import add_model_arguments, worker_argv
from clef_worker.errors import StartupError
from clef_worker.model import short_conv, swap
from clef_worker.model.module_names import MODELING_MODULE
from clef_worker.model.short_conv import (
    FLA_CONV_MODULE,
    FLA_PATH,
    FUNCTION_NAME,
    TORCH_PATH,
    FlaShortConv,
)

CUDA = torch.device("cuda")  # a device object only: nothing here touches CUDA
CPU = torch.device("cpu")


def transformers_conv() -> Callable[..., torch.Tensor]:
    """transformers' own `causal_conv1d_fn` ([B, D, T] in and out), whatever is bound now."""
    return swap.original(importlib.import_module(MODELING_MODULE), FUNCTION_NAME)


class FlaLayoutConv:
    """fla's `causal_conv1d` calling convention around transformers' arithmetic; records what
    each call received and refuses any layout but fla's."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.arithmetic = transformers_conv()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 initial_state: torch.Tensor | None = None,
                 output_final_state: bool | None = False, activation: str | None = None,
                 backend: str | None = "triton", cu_seqlens: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert weight is not None and x.dim() == 3 and x.shape[-1] == weight.shape[0], \
            "fla takes x as [B, T, D] and weight as [D, W]"
        assert x.dtype == weight.dtype, "fla computes in one dtype"
        self.calls.append({"x": x, "backend": backend, "cu_seqlens": cu_seqlens,
                           "residual": residual, "initial_state": initial_state})
        y = self.arithmetic(x.transpose(1, 2), weight, bias, activation=activation)
        return y.transpose(1, 2), None


@pytest.fixture
def modeling() -> Iterator[Any]:
    """transformers' Qwen3.5 module with its torch `causal_conv1d_fn`, restored after the test
    whatever the test bound."""
    module: Any = importlib.import_module(MODELING_MODULE)
    short_conv.uninstall(module)
    before = module.causal_conv1d_fn
    yield module
    module.causal_conv1d_fn = before


@pytest.fixture
def fake_fla(monkeypatch: pytest.MonkeyPatch) -> FlaLayoutConv:
    """An importable `fla.modules.convolution` whose `causal_conv1d` is the double."""
    kernel = FlaLayoutConv()
    fake = types.ModuleType(FLA_CONV_MODULE)
    fake.causal_conv1d = kernel  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, FLA_CONV_MODULE, fake)
    return kernel


def transformers_layout(rows: int, channels: int, length: int, seed: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, D, T] as transformers hands it over: the transpose of a [B, T, D] projection."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, length, channels, generator=generator).to(dtype).transpose(1, 2)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), channels=st.integers(1, 40), length=st.integers(1, 70),
       with_bias=st.booleans(), activation=st.sampled_from([None, "silu"]),
       seed=st.integers(0, 2**16))
def test_adapter_keeps_transformers_layout_contract(rows: int, channels: int, length: int,
                                                     with_bias: bool, activation: str | None,
                                                     seed: int) -> None:
    """What transformers passes in ([B, D, T], a transposed view) comes back from fla's
    convention bit for bit as transformers' own function answers it."""
    reference = transformers_conv()
    assert not isinstance(reference, FlaShortConv)
    kernel = FlaLayoutConv()
    adapter = FlaShortConv(kernel, reference)
    generator = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(channels, 4, generator=generator)
    bias = torch.randn(channels, generator=generator) if with_bias else None
    hidden = transformers_layout(rows, channels, length, seed)
    got = adapter(hidden, weight, bias, activation=activation)
    expected = reference(hidden, weight, bias, activation=activation)
    assert got.shape == expected.shape == (rows, channels, length)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    (call,) = kernel.calls
    assert call["backend"] == "triton" and call["cu_seqlens"] is None
    assert call["residual"] is None and call["initial_state"] is None
    # The kernel reads the projection where it lies: [B, T, D] with no copy.
    assert call["x"].data_ptr() == hidden.data_ptr() and call["x"].is_contiguous()


def test_adapter_keeps_transformers_dtypes() -> None:
    """Input in bfloat16, weights in float32: computed in the weights' dtype, returned in the
    input's, as transformers' function does."""
    reference = transformers_conv()
    adapter = FlaShortConv(FlaLayoutConv(), reference)
    hidden = transformers_layout(2, 12, 9, seed=3, dtype=torch.bfloat16)
    weight = torch.randn(12, 4, generator=torch.Generator().manual_seed(4))
    got = adapter(hidden, weight, None, activation="silu")
    expected = reference(hidden, weight, None, activation="silu")
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_calls_fla_cannot_serve_go_to_the_original() -> None:
    """Packed sequences and activations fla's kernel does not fuse keep transformers' path."""
    original_calls: list[dict[str, Any]] = []

    def original(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        original_calls.append({"activation": activation, **kwargs})
        return hidden

    kernel = FlaLayoutConv()
    adapter = FlaShortConv(kernel, original)
    hidden, weight = transformers_layout(1, 4, 5, seed=0), torch.ones(4, 4)
    adapter(hidden, weight, None, activation="gelu")
    adapter(hidden, weight, None, activation="silu", seq_idx=torch.zeros(1, 5))
    adapter(hidden, weight, None, activation="silu", cu_seqlens=torch.tensor([0, 5]))
    assert [call["activation"] for call in original_calls] == ["gelu", "silu", "silu"]
    assert kernel.calls == []
    adapter(hidden, weight, None, activation="swish", cu_seqlens=None)
    assert len(kernel.calls) == 1 and len(original_calls) == 3


def test_cpu_binds_nothing(modeling: Any, fake_fla: FlaLayoutConv) -> None:
    before = modeling.causal_conv1d_fn
    assert short_conv.bind_short_conv(CPU, "torch") == TORCH_PATH
    assert modeling.causal_conv1d_fn is before
    with pytest.raises(StartupError, match="--short-conv fla needs CUDA"):
        short_conv.bind_short_conv(CPU, "torch", "fla")
    assert modeling.causal_conv1d_fn is before


def test_cuda_with_fla_binds_the_adapter_once(modeling: Any, fake_fla: FlaLayoutConv,
                                              caplog: pytest.LogCaptureFixture) -> None:
    original = modeling.causal_conv1d_fn
    with caplog.at_level(logging.INFO, logger="clef_worker.model.short_conv"):
        assert short_conv.bind_short_conv(CUDA, "fla") == FLA_PATH
    assert caplog.text.count("short convolution: fla-triton") == 1
    adapter = short_conv.installed(modeling)
    assert adapter is not None and adapter.kernel is fake_fla and adapter.original is original
    assert short_conv.bind_short_conv(CUDA, "fla", "fla") == FLA_PATH
    again = short_conv.installed(modeling)
    assert again is not None and again.original is original, "an adapter must not wrap one"
    # --short-conv torch, or the torch Gated DeltaNet path, puts transformers' function back.
    assert short_conv.bind_short_conv(CUDA, "fla", "torch") == TORCH_PATH
    assert modeling.causal_conv1d_fn is original
    short_conv.bind_short_conv(CUDA, "fla")
    assert short_conv.bind_short_conv(CUDA, "torch") == TORCH_PATH
    assert modeling.causal_conv1d_fn is original
    with pytest.raises(StartupError, match="fla Gated DeltaNet path"):
        short_conv.bind_short_conv(CUDA, "torch", "fla")


def test_the_gdn_layer_runs_the_bound_kernel(modeling: Any, fake_fla: FlaLayoutConv) -> None:
    """`Qwen3_5GatedDeltaNet.forward` looks the function up at call time: after binding, the
    layer's convolution goes through the adapter and its output is unchanged."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=16,
        intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )
    layer = modeling.Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    hidden = torch.randn(2, 11, 32)
    with torch.inference_mode():
        expected = layer(hidden)
        assert short_conv.bind_short_conv(CUDA, "fla") == FLA_PATH
        got = layer(hidden)
    assert len(fake_fla.calls) == 1
    assert fake_fla.calls[0]["x"].shape == (2, 11, layer.conv_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_an_unusable_fla_keeps_torch(modeling: Any, monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    before = modeling.causal_conv1d_fn
    monkeypatch.setitem(sys.modules, FLA_CONV_MODULE, None)  # the import raises ImportError
    with caplog.at_level(logging.WARNING, logger="clef_worker.model.short_conv"):
        assert short_conv.bind_short_conv(CUDA, "fla") == TORCH_PATH
    assert "causal_conv1d is not usable (ModuleNotFoundError" in caplog.text
    assert modeling.causal_conv1d_fn is before
    with pytest.raises(StartupError, match=f"cannot import {FLA_CONV_MODULE}"):
        short_conv.bind_short_conv(CUDA, "fla", "fla")
    monkeypatch.setitem(sys.modules, FLA_CONV_MODULE, types.ModuleType(FLA_CONV_MODULE))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clef_worker.model.short_conv"):
        assert short_conv.bind_short_conv(CUDA, "fla") == TORCH_PATH
    assert "has no causal_conv1d" in caplog.text
    assert modeling.causal_conv1d_fn is before


def test_unknown_mode_is_refused(modeling: Any) -> None:
    with pytest.raises(StartupError, match="--short-conv triton: expected auto, fla, torch"):
        short_conv.bind_short_conv(CUDA, "fla", "triton")


def test_short_conv_flag_reaches_the_worker() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args([]).short_conv == "auto"
    args = parser.parse_args(["--short-conv", "torch"])
    assert parser.parse_args(worker_argv(args)).short_conv == "torch"
    with pytest.raises(SystemExit):
        parser.parse_args(["--short-conv", "triton"])

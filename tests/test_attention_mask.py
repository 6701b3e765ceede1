"""Capture and eager run the same attention: every forward of the text stack hands transformers
no masks (clef_worker.model.backbone.NO_MASKS), so SDPA gets no mask and runs causal even when
transformers believes it is tracing, as it does inside a CUDA-graph capture. Simulated here by
making transformers' `is_tracing` answer true."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.masking_utils as masking

from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.native import NativeExecutor


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               limits=RequestLimits(max_length=512))


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every SDPA call's mask and causal flag."""
    calls: list[dict[str, Any]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append({"mask": kwargs.get("attn_mask"), "causal": kwargs.get("is_causal")})
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    yield calls


def _simulate_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(masking, "is_tracing", lambda *args, **kwargs: True)


IDS = (torch.arange(2 * 40) % 50 + 3).view(2, 40)


def test_under_a_simulated_capture_sdpa_gets_no_mask_and_runs_causal(
        executor: NativeExecutor, sdpa_calls: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    with torch.inference_mode():
        eager = executor.backbone.last_hidden_state(IDS)
        eager_calls = list(sdpa_calls)
        sdpa_calls.clear()
        _simulate_capture(monkeypatch)
        captured = executor.backbone.last_hidden_state(IDS)
    assert eager_calls and sdpa_calls and len(sdpa_calls) == len(eager_calls)
    assert all(call["mask"] is None and call["causal"] is True for call in sdpa_calls)
    assert torch.equal(captured, eager)


def test_transformers_own_masks_would_differ_under_capture(
        executor: NativeExecutor, sdpa_calls: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the masks are passed: left to build them, transformers materialises a mask under
    capture and SDPA runs non-causal with a bias (the call this project never makes)."""
    _simulate_capture(monkeypatch)
    with torch.inference_mode():
        executor.backbone.model(input_ids=IDS, use_cache=False)
    assert sdpa_calls and all(call["mask"] is not None and call["causal"] is False
                              for call in sdpa_calls)


def test_answers_are_unchanged_under_a_simulated_capture(
        executor: NativeExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    request = {"model": "m", "state": "an invoice was paid twice " * 8,
               "questions": {"q": {"type": "noul"}, "c": {"type": "choice",
                                                          "criteria": {"a": None, "b": None}}}}
    want = executor.score(request)
    _simulate_capture(monkeypatch)
    got = executor.score(request)
    assert got.logits == want.logits and got.response() == want.response()

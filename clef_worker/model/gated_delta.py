"""The Gated DeltaNet prefill in plain torch, for CPU workers: chunked, with small chunks.

Why not transformers' own torch fallback (`torch_chunk_gated_delta_rule`): it works in chunks of
64 tokens, so every token pays for a 64-wide row of the intra-chunk decay, attention and
triangular-system matrices. With Qwen3.5's narrow heads (16 wide in the demo and the tiny
fixture, 128 in the release) those C x C products and the per-chunk triangular solves outweigh
the state products, and at several rows per forward the [rows, heads, chunks, 64, 64]
intermediates outgrow the L2 cache. Chunks of 16 or 32 cut that per-token arithmetic two to four
times; the price is more iterations of the sequential scan over chunks, a cost per forward that a
batch shares. Measured on CPU (`bench/bench_gated_delta.py`): see docs/benchmarks.md.

The arithmetic is the same chunked gated delta rule (the WY form of the delta rule with decay,
as in fla and transformers), in float32 whatever the input dtype:

- per chunk: cumulative log-decay `c`, pairwise decays `exp(c_i - c_j)` below the diagonal, the
  unit lower-triangular system `I + tril(beta k k^T * decay, -1)`, solved once for the values and
  the decayed keys together (one solve with both right-hand sides side by side);
- then the scan: each chunk reads the state (queries and the solved keys in one product), adds
  its intra-chunk attention and updates the state.

Only the chunk size differs from transformers' function, so results agree to float32 rounding
(about 1e-6 on the layer output; `tests/test_gated_delta.py`). `install` puts it in place of
transformers' module-level function, which `Qwen3_5GatedDeltaNet.forward` looks up at call time
(`clef_worker.model.swap`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from clef_worker.model import swap

log = logging.getLogger(__name__)

KERNEL_NAME = "torch_chunk_gated_delta_rule"
# Chunk sizes by rows in the forward, measured on CPU at ~440-token rows (docs/benchmarks.md):
# one row is fastest with 32 (fewer scan steps), several rows with 16 (less work per token, and
# the scan's fixed cost is shared by the rows).
SINGLE_ROW_CHUNK = 32
BATCH_CHUNK = 16
L2_NORM_EPS = 1e-6  # fla's and transformers' q/k normalisation epsilon


def chunk_size_for(rows: int) -> int:
    """The chunk size for a forward of `rows` rows."""
    return SINGLE_ROW_CHUNK if rows <= 1 else BATCH_CHUNK


def chunked_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    checkpoints: tuple[int, ...] = (),
    **_: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' `torch_chunk_gated_delta_rule` contract: q, k [B, T, Hk, dk], v [B, T, Hv,
    dv], g (log decay, <= 0) and beta [B, T, Hv] -> (output [B, T, Hv, dv] in q's dtype, final
    state [B, Hv, dk, dv] or None). Each key head serves Hv / Hk consecutive value heads.

    `checkpoints` (token offsets, each a multiple of the chunk or T itself): the second value is
    then the states after those tokens, stacked `[len, B, Hv, dk, dv]`, read off the scan as it
    passes them (the prefix cache's states, clef_worker.model.prefix_forward). The padded tail
    of the last chunk writes nothing (zero keys, beta and log decay), so T's state is exact."""
    out_dtype = query.dtype
    rows, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    chunk = chunk_size or chunk_size_for(rows)
    q = query.float()
    k = key.float()
    if use_qk_l2norm_in_kernel:  # per vector, so before repeating the heads is the same
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_NORM_EPS)
    q = q * key_dim**-0.5
    if key_heads != value_heads:
        q = q.repeat_interleave(value_heads // key_heads, dim=2)
        k = k.repeat_interleave(value_heads // key_heads, dim=2)
    pad = -length % chunk
    chunks = (length + pad) // chunk
    streams = rows * value_heads  # one independent recurrence per (row, value head)

    def chunked(x: Tensor) -> Tensor:  # [B, T, H, d] -> [B*H, N, C, d]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(streams, chunks, chunk, x.shape[-1])

    def chunked_gate(x: Tensor) -> Tensor:  # [B, T, H] -> [B*H, N, C]
        x = x.float().transpose(1, 2)
        if pad:
            x = F.pad(x, (0, pad))
        return x.reshape(streams, chunks, chunk)

    q, k, v = chunked(q), chunked(k), chunked(value.float())
    b = chunked_gate(beta).unsqueeze(-1)
    decay_log = chunked_gate(g).cumsum(-1)  # c: [B*H, N, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pairwise = (decay_log.unsqueeze(-1) - decay_log.unsqueeze(-2)).masked_fill_(
        ~causal, float("-inf")).exp_()  # exp(c_i - c_j) for j <= i, else 0
    k_beta = k * b
    k_t = k.transpose(-1, -2)
    system = torch.matmul(k_beta, k_t).mul_(pairwise)  # the solve reads its strict lower part
    decay = decay_log.exp().unsqueeze(-1)
    solved = torch.linalg.solve_triangular(
        system, torch.cat([v * b, k_beta * decay], dim=-1), upper=False, unitriangular=True)
    new_values = solved[..., :value_dim]  # u: [B*H, N, C, dv]
    # Rows 0..C-1: decayed queries; rows C..2C-1: the solved keys (w). One product reads both.
    readers = torch.cat([q * decay, solved[..., value_dim:]], dim=-2)
    attention = torch.matmul(q, k_t).mul_(pairwise)
    writers = (k * (decay_log[..., -1:] - decay_log).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = decay_log[..., -1].exp()[..., None, None]  # [B*H, N, 1, 1]

    if initial_state is None:
        state = q.new_zeros(streams, key_dim, value_dim)
    else:
        state = initial_state.float().reshape(streams, key_dim, value_dim)
    wanted = {}
    for at in checkpoints:
        if (at % chunk and at != length) or not 0 < at <= length:
            raise ValueError(f"checkpoint {at}: must be a multiple of the chunk ({chunk}) or "
                             f"the length ({length}), within (0, {length}]")
        wanted[-(-at // chunk) - 1] = at
    kept: dict[int, Tensor] = {}
    outputs = []
    for index in range(chunks):
        read = torch.bmm(readers[:, index], state)  # [B*H, 2C, dv]
        corrected = new_values[:, index] - read[:, chunk:]
        outputs.append(torch.baddbmm(read[:, :chunk], attention[:, index], corrected))
        state = torch.baddbmm(state * chunk_decay[:, index], writers[:, index], corrected)
        if index in wanted:
            kept[wanted[index]] = state.reshape(rows, value_heads, key_dim, value_dim)
    output = torch.stack(outputs, dim=1).reshape(rows, value_heads, chunks * chunk, value_dim)
    output = output[:, :, :length].transpose(1, 2).to(out_dtype).contiguous()
    if checkpoints:
        return output, torch.stack([kept[at] for at in checkpoints])
    final = state.reshape(rows, value_heads, key_dim, value_dim) if output_final_state else None
    return output, final


def _kernel(original: Callable[..., Any]) -> Callable[..., Any]:
    """The function installed in transformers' module: ours, except for packed varlen calls
    (`cu_seqlens`), which this server never makes; those keep transformers' behaviour."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seqlens") is not None:
            return original(*args, **kwargs)
        return chunked_gated_delta_rule(*args, **kwargs)

    return kernel


def is_installed(module: ModuleType) -> bool:
    return swap.replacement(module, KERNEL_NAME) is not None


def install(module: ModuleType) -> None:
    """Put the small-chunk kernel in place of transformers' torch fallback in `module` (its
    Qwen3.5 modelling module). Process-wide and idempotent; only for the torch path."""
    if is_installed(module):
        return
    swap.replace(module, KERNEL_NAME, _kernel)
    log.info("Gated DeltaNet torch kernel: clef's chunked rule (chunks of %d, %d with several "
             "rows)", SINGLE_ROW_CHUNK, BATCH_CHUNK)


def uninstall(module: ModuleType) -> None:
    """Restore transformers' own function (tests, and a process that must run the reference)."""
    swap.restore(module, KERNEL_NAME)

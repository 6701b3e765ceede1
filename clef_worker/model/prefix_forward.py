"""The text stack over requests' new tokens only, each continuing from cached states.

Why: a request that begins with tokens the worker has already read (the same state asked again,
or a state that grew by a few events) needs only its suffix computed. The Qwen3.5 stack carries
everything a later token needs from earlier ones in three places, and each continues exactly:

- **Gated DeltaNet recurrent state** `[Hv, dk, dv]` (float32): the delta rule's scan simply
  starts from it instead of zero (`initial_state`).
- **Gated DeltaNet short convolution**: its causal taps reach back `K-1` tokens, so the last
  `K-1` rows of the convolution's input before the cut are prepended to the new rows and the
  outputs they produce dropped.
- **Full attention**: the cached keys and values (after RoPE) are concatenated before the new
  ones, and the new tokens' rotary positions continue at the cut; a new token attends to every
  cached token and causally to the new ones.

The head needs every token's final hidden state (its memory), so the caller concatenates the
cached hidden states before the new ones (clef_worker.serving.runner).

Media (clef_worker.media.vision): a request holding media runs from nothing with the input
embeddings and the three rotary rows (t, h, w) the vision path gives it (`MediaInputs`); text
after the media continues at the media's largest position + 1, not at its token index, so every
cached point records its `rope_delta` (the text's rotary position minus its token index: 0
without media, negative after an image), and a suffix continues at `start + rope_delta`, as the
whole forward would. Points of a media request lie at or after the end of its media tokens
(clef_worker.serving.prefix.cache), so a suffix is always text and never needs the tower.

The same pass records what the cache keeps (`Captured`): at each requested point (an absolute
position inside the new tokens) the recurrent state and the convolution's input tail, and the
new tokens' keys, values and hidden states, which the cache cuts into blocks. On the torch path
the recurrent states at the points come out of the chunked scan itself for free
(`gated_delta.chunked_gated_delta_rule(checkpoints=...)`; points are multiples of its chunk);
on the fla path (CUDA) the delta rule runs in rounds, one varlen call per segment between
points, each from the previous segment's final state (`initial_state` with `cu_seqlens`: eager,
never captured).

Requests are laid end to end in one `[1, T_new, H]` row, as in a packed forward
(clef_worker.model.packed_layers): norms, projections and MLP run over the whole row; the token
mixers run per sequence. A request without a cached prefix and without points is computed as
the per-sequence packed path computes it.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from clef_worker.model import gated_delta, short_conv
from clef_worker.model.module_names import MODELING_MODULE
from clef_worker.model.packed_kernels import attend
from clef_worker.model.packed_layers import (
    attention_inputs,
    attention_output,
    delta_rule_inputs,
)


@dataclass(frozen=True)
class PrefixState:
    """A sequence's states after its first `start` tokens, per layer kind (layer order)."""

    start: int
    recurrent: list[Tensor]  # per Gated DeltaNet layer: [Hv, dk, dv], float32
    conv: list[Tensor]  # per Gated DeltaNet layer: the conv inputs before `start`, [<=K-1, D]
    keys: list[Tensor]  # per attention layer: [kv heads, start, head dim], after RoPE
    values: list[Tensor]  # per attention layer: [kv heads, start, head dim]
    # The rotary position of the token at `start` minus `start` (media before it: negative).
    rope_delta: int = 0


@dataclass(frozen=True)
class SequencePlan:
    """One request of the forward: its new tokens, the cached states it continues from (None:
    from nothing) and the absolute positions where its states are to be captured."""

    length: int  # new tokens
    prefix: PrefixState | None = None
    points: tuple[int, ...] = ()

    @property
    def start(self) -> int:
        return self.prefix.start if self.prefix is not None else 0

    @property
    def rope_delta(self) -> int:
        return self.prefix.rope_delta if self.prefix is not None else 0


@dataclass(frozen=True)
class MediaInputs:
    """A media request's inputs for its new tokens (all of its tokens: it runs from nothing):
    the input embeddings `[n, H]` with the tower's outputs in place of the pads, and the rotary
    position rows `[3, n]` (clef_worker.media.vision.VisionTower.inputs)."""

    embeds: Tensor
    positions: Tensor


@dataclass
class Captured:
    """What one request's forward recorded for the cache: per point, each Gated DeltaNet layer's
    recurrent state and convolution input tail; per attention layer, the new tokens' keys and
    values (`[kv heads, n, d]`, the cache slices them into blocks)."""

    points: tuple[int, ...]
    recurrent: list[list[Tensor]] = field(default_factory=list)  # [point][layer]
    conv: list[list[Tensor]] = field(default_factory=list)  # [point][layer]
    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    rope_deltas: list[int] = field(default_factory=list)  # [point]: see `PrefixState`


def modeling_module() -> Any:
    return importlib.import_module(MODELING_MODULE)


# -------------------------------------------------------------------------------------------
# The delta rule from initial states, with states at points


DeltaRuleRun = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Sequence[tuple[int, int]],
                         Sequence[Tensor | None], Sequence[Sequence[int]]],
                        tuple[Tensor, list[list[Tensor]]]]


def torch_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
                     spans: Sequence[tuple[int, int]], initial: Sequence[Tensor | None],
                     points: Sequence[Sequence[int]]) -> tuple[Tensor, list[list[Tensor]]]:
    """Per sequence, clef's chunked rule (one-row chunk) from its initial state; the states at
    each sequence's points (offsets within its new tokens) come out of the scan."""
    outputs, states = [], []
    for (start, end), state, marks in zip(spans, initial, points, strict=True):
        span = slice(start, end)
        output, found = gated_delta.chunked_gated_delta_rule(
            query[:, span], key[:, span], value[:, span], g[:, span], beta[:, span],
            chunk_size=gated_delta.SINGLE_ROW_CHUNK,
            initial_state=None if state is None else state.unsqueeze(0),
            use_qk_l2norm_in_kernel=True, checkpoints=tuple(marks))
        outputs.append(output)
        states.append([] if found is None else [s[0] for s in found])
    return torch.cat(outputs, dim=1), states


def fla_delta_rule(kernel: Callable[..., Any]) -> DeltaRuleRun:
    """fla's `chunk_gated_delta_rule` in rounds: round r holds every sequence's r-th segment
    (between its points) as one varlen call with `cu_seqlens`, each segment starting from the
    state the previous round ended with (`initial_state`, `output_final_state`). Offsets are
    built on the host: eager only."""

    def run(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor,
            spans: Sequence[tuple[int, int]], initial: Sequence[Tensor | None],
            points: Sequence[Sequence[int]]) -> tuple[Tensor, list[list[Tensor]]]:
        segments = [segment_bounds(end - start, marks)
                    for (start, end), marks in zip(spans, points, strict=True)]
        heads, key_dim = value.shape[2], query.shape[-1]
        value_dim = value.shape[-1]
        state: list[Tensor] = [
            s.float() if s is not None else query.new_zeros(heads, key_dim, value_dim,
                                                            dtype=torch.float32)
            for s in initial]
        output = torch.empty_like(value)
        states: list[list[Tensor]] = [[] for _ in spans]
        for round_index in range(max(len(bounds) for bounds in segments)):
            members = [i for i, bounds in enumerate(segments) if round_index < len(bounds)]
            rows, offsets = [], [0]
            for i in members:
                first, last = segments[i][round_index]
                rows.append(torch.arange(spans[i][0] + first, spans[i][0] + last))
                offsets.append(offsets[-1] + last - first)
            index = torch.cat(rows).to(query.device)
            cu = torch.tensor(offsets, dtype=torch.int32, device=query.device)
            part, final = kernel(*(t.index_select(1, index) for t in (query, key, value)),
                                 g=g.index_select(1, index), beta=beta.index_select(1, index),
                                 initial_state=torch.stack([state[i] for i in members]),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 cu_seqlens=cu)
            output.index_copy_(1, index, part.to(output.dtype))
            for slot, i in enumerate(members):
                state[i] = final[slot].float()
                first, last = segments[i][round_index]
                if last in points[i]:
                    states[i].append(state[i])
        return output, states

    return run


def segment_bounds(length: int, marks: Sequence[int]) -> list[tuple[int, int]]:
    """The segments `[a, b)` of a sequence of `length` new tokens cut at `marks` (offsets)."""
    cuts = [0, *(m for m in marks if 0 < m < length), length]
    return list(itertools.pairwise(cuts))


# -------------------------------------------------------------------------------------------
# The layers


def gated_delta_net(mixer: Any, x: Tensor, plans: Sequence[SequencePlan],
                    spans: Sequence[tuple[int, int]], layer: int, delta_rule: DeltaRuleRun,
                    captured: Sequence[Captured]) -> Tensor:
    """transformers' `Qwen3_5GatedDeltaNet.forward` over the new tokens, each sequence
    continuing from its cached convolution tail and recurrent state."""
    rows, length, _ = x.shape
    mixed = mixer.in_proj_qkv(x)
    z = mixer.in_proj_z(x).reshape(rows, length, -1, mixer.head_v_dim)
    b = mixer.in_proj_b(x)
    a = mixer.in_proj_a(x)
    weight = mixer.conv1d.weight.squeeze(1)
    width = weight.shape[-1]
    conv = getattr(modeling_module(), short_conv.FUNCTION_NAME)
    convolved = []
    for plan, (start, end), record in zip(plans, spans, captured, strict=True):
        tail = plan.prefix.conv[layer] if plan.prefix is not None else mixed.new_zeros(0, 0)
        rows_in = mixed[0, start:end]
        extended = torch.cat([tail.to(rows_in.dtype), rows_in]) if tail.numel() else rows_in
        out = conv(extended.T.unsqueeze(0), weight, mixer.conv1d.bias,
                   activation=mixer.activation).transpose(1, 2)
        convolved.append(out[:, extended.shape[0] - rows_in.shape[0]:])
        kept = extended.shape[0] - rows_in.shape[0]
        for at, point in enumerate(plan.points):
            offset = kept + point - plan.start
            record.conv[at].append(extended[max(0, offset - (width - 1)):offset].clone())
    mixed = torch.cat(convolved, dim=1)
    query, key, value, g, beta = delta_rule_inputs(mixer, mixed, a, b, rows, length)
    initial = [plan.prefix.recurrent[layer] if plan.prefix is not None else None
               for plan in plans]
    marks = [tuple(point - plan.start for point in plan.points) for plan in plans]
    core, states = delta_rule(query, key, value, g, beta, spans, initial, marks)
    for record, found in zip(captured, states, strict=True):
        for at, state in enumerate(found):
            record.recurrent[at].append(state.clone())
    core = mixer.norm(core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(core.reshape(rows, length, -1))


def full_attention(module: Any, x: Tensor, rotary: tuple[Tensor, Tensor],
                   plans: Sequence[SequencePlan], spans: Sequence[tuple[int, int]], layer: int,
                   captured: Sequence[Captured]) -> Tensor:
    """transformers' `Qwen3_5Attention.forward` over the new tokens, each sequence attending to
    its cached keys and values too."""
    query, key, value, gate = attention_inputs(module, x, rotary)
    outputs = []
    for plan, (start, end), record in zip(plans, spans, captured, strict=True):
        new_key, new_value = key[:, :, start:end], value[:, :, start:end]
        if plan.points:
            record.keys.append(new_key[0])
            record.values.append(new_value[0])
        if plan.prefix is not None:
            new_key = torch.cat([plan.prefix.keys[layer].unsqueeze(0), new_key], dim=2)
            new_value = torch.cat([plan.prefix.values[layer].unsqueeze(0), new_value], dim=2)
        outputs.append(attend(module, query[:, :, start:end], new_key, new_value))
    return attention_output(module, torch.cat(outputs, dim=1), gate)


def delta_rule_for(gdn_path: str) -> DeltaRuleRun:
    """The delta rule the prefixed forward runs: fla's varlen kernel in rounds on the fla path,
    clef's chunked torch rule elsewhere."""
    if gdn_path == "fla":
        from clef_worker.model.module_names import FLA_KERNEL_MODULE

        return fla_delta_rule(importlib.import_module(FLA_KERNEL_MODULE).chunk_gated_delta_rule)
    return torch_delta_rule


def prefixed_forward(model: Any, input_ids: Tensor, plans: Sequence[SequencePlan],
                     delta_rule: DeltaRuleRun, media: MediaInputs | None = None
                     ) -> tuple[Tensor, list[Captured]]:
    """Last hidden state (after the final norm) of every request's new tokens, end to end:
    `[sum n]` ids -> `[sum n, H]`, and what each request captured at its points. `media`: the
    inputs of a lone media request running from nothing (its embeddings and rotary rows
    replace the ids' embeddings and the continued positions)."""
    lengths = [plan.length for plan in plans]
    if input_ids.dim() != 1 or input_ids.shape[0] != sum(lengths) or min(lengths) < 1:
        raise ValueError(f"prefixed input_ids must be [{sum(lengths)}] (every request's new "
                         f"tokens, at least one each), got {list(input_ids.shape)}")
    for plan in plans:
        if any(not plan.start < p <= plan.start + plan.length for p in plan.points):
            raise ValueError(f"capture points {plan.points} outside the new tokens "
                             f"({plan.start}, {plan.start + plan.length}]")
    spans, offset = [], 0
    for length in lengths:
        spans.append((offset, offset + length))
        offset += length
    captured = [Captured(plan.points, [[] for _ in plan.points], [[] for _ in plan.points])
                for plan in plans]
    if media is None:
        positions = torch.cat([torch.arange(plan.start + plan.rope_delta,
                                            plan.start + plan.rope_delta + plan.length)
                               for plan in plans]).to(input_ids.device)
        hidden = model.embed_tokens(input_ids).unsqueeze(0)
        rotary = model.rotary_emb(hidden, positions.unsqueeze(0))
        for plan, record in zip(plans, captured, strict=True):
            record.rope_deltas = [plan.rope_delta] * len(plan.points)
    else:
        [plan] = plans
        if plan.prefix is not None or media.positions.shape != (3, plan.length):
            raise ValueError("media inputs are for one request from nothing: rotary rows "
                             f"[3, {plan.length}] expected, got {list(media.positions.shape)}")
        hidden = media.embeds.to(input_ids.device).unsqueeze(0)
        rotary = model.rotary_emb(hidden, media.positions.unsqueeze(1))
        # After the media every row is the text's position: the next token's is the largest
        # so far + 1 (clef_worker.media.vision.rope_positions).
        captured[0].rope_deltas = [int(media.positions[:, :point].max()) + 1 - point
                                   for point in plan.points]
    linear = attention = 0
    for layer in model.layers[: model.config.num_hidden_layers]:
        residual = hidden
        mixed = layer.input_layernorm(hidden)
        if layer.block_type == "linear_attention":
            mixed = gated_delta_net(layer.linear_attn, mixed, plans, spans, linear, delta_rule,
                                    captured)
            linear += 1
        else:
            mixed = full_attention(layer.self_attn, mixed, rotary, plans, spans, attention,
                                   captured)
            attention += 1
        hidden = residual + mixed
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.norm(hidden)[0], captured

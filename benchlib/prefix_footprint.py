"""What the worker's prefix cache holds per cached token and per cached point, from a model's
shapes (the figures docs/benchmarks.md gives for Clef-Flash; `/health`'s `bytes` is the measured
truth on a running worker).

Per token: each full-attention layer's key and value (after RoPE), and the final hidden state
(the joint head's memory), in the serving dtype. Per cached point (every `block_tokens` and the
end of a state): each Gated DeltaNet layer's recurrent state `[value heads, key dim, value dim]`
in float32 (the delta rule's scan accumulates in it) and its short convolution's input tail
(`kernel - 1` rows of the convolution's channels) in the serving dtype.
"""

from __future__ import annotations

from typing import Any

FLOAT32_BYTES = 4


def footprint(shape: dict[str, Any], *, dtype_bytes: int = 2, block_tokens: int = 256,
              conv_kernel: int = 4) -> dict[str, int | float]:
    """Bytes per cached token, per cached point, and per token at one point per block."""
    layers = int(shape["num_hidden_layers"])
    kinds = shape.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0
                                         else "linear_attention" for i in range(layers)]
    attention = kinds.count("full_attention")  # Qwen3.5's default: every fourth layer
    delta = layers - attention
    kv = 2 * int(shape["num_key_value_heads"]) * int(shape["head_dim"]) * dtype_bytes
    per_token = attention * kv + int(shape["hidden_size"]) * dtype_bytes
    key_dim = int(shape["linear_num_key_heads"]) * int(shape["linear_key_head_dim"])
    value_heads, value_dim = int(shape["linear_num_value_heads"]), int(
        shape["linear_value_head_dim"])
    recurrent = value_heads * int(shape["linear_key_head_dim"]) * value_dim * FLOAT32_BYTES
    conv = (2 * key_dim + value_heads * value_dim) * (conv_kernel - 1) * dtype_bytes
    per_point = delta * (recurrent + conv)
    return {
        "per_token_bytes": per_token,
        "per_point_bytes": per_point,
        "block_tokens": block_tokens,
        "per_token_at_blocks_bytes": round(per_token + per_point / block_tokens, 1),
    }

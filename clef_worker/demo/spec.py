"""The demo snapshot's shape parameters and generator format (part of the cache fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass

DEMO_FORMAT = 1
"""Bump when the generator's output changes for the same library versions."""


@dataclass(frozen=True)
class DemoSpec:
    """Shape parameters of a generated snapshot; the default is the tiny `--model demo` one."""

    hidden_size: int = 64
    num_layers: int = 4
    full_attention_interval: int = 4
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    head_width: int = 32
    head_routing_layers: int = 2
    head_layers: int = 2
    head_heads: int = 4
    head_feedforward: int = 64
    tokenizer_vocab: int = 1024
    seed: int = 0

    @classmethod
    def wide(cls) -> DemoSpec:
        """A wider random model for benchmarks: real-ish per-token widths, few layers."""
        return cls(
            hidden_size=1024,
            num_layers=4,
            intermediate_size=3072,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_head_dim=64,
            head_width=256,
            head_routing_layers=2,
            head_layers=2,
            head_heads=4,
            head_feedforward=1024,
        )


DEFAULT_SPEC = DemoSpec()
"""The tiny `--model demo` snapshot."""

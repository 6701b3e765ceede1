"""The batch policy: one owner, resolved once per worker from its flags.

Why one owner: the layout, the token budget, the window and the most requests a forward may
hold decide both how the serve loop groups requests (clef_worker.serving.batching) and which graph
shapes warm-up captures (clef_worker.serving.gpu). Resolved in two places they drift: a
`--max-batch 32` the graphs never heard of silently lost batched replays for groups of 17-32. So
the worker
resolves the policy once, where the executor is loaded (`BatchPolicy.from_flags`), builds its
shapes from it, keeps it on the executor (`executor.policy`), and the serve loop and `ready`
read it there; the front reads the budget and the in-flight cap from `ready` only.

The per-device default numbers live in `clef_protocol.options` beside the flags that override them
(their help states them); applying them is the worker's alone (the functions below).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from clef_protocol.options import (
    BATCH_LAYOUTS,
    DEFAULT_MAX_BATCH_CPU,
    DEFAULT_MAX_BATCH_CUDA,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_TOKENS_CPU,
)

PACKED = "packed"
PADDED = "padded"
# CPU's `--batch-layout auto`: each group padded when its lengths are uniform enough that
# padding wastes little (`group_layout`), else packed. Not a flag value: `auto` resolves to it.
PER_GROUP = "per-group"
LAYOUTS = (PACKED, PADDED, PER_GROUP)

# The most padding a group may carry and still run padded under PER_GROUP: the share of the
# padded batch's tokens (rows x longest) that are pad. On CPU a packed row runs the gated delta
# rule, the attention and the short convolution once per sequence (clef_worker.model
# .packed_layers), so per request it costs about a forward of its own, while a padded batch
# runs them once over all rows: on uniform lengths padded is faster, on mixed lengths packed
# is, because padded computes every pad token. Measured for one group of 8 on the tiny
# snapshot, in one process (bench/bench_group_layout.py; docs/benchmarks.md, "Packed against
# padded batches"): padded ahead at low waste, packed ahead from about 15-20 %.
MAX_PADDED_WASTE = 0.15

# `--batch-layout auto`. On CPU, PER_GROUP (above). On CUDA no GPU run has
# compared them yet: packed is the default there too because it is the layout whose graph
# shapes fit a first sitting (at most 32 total-token buckets against about 110 [rows, bucket]
# shapes); the GPU script measures both side by side (bench/gpu_session.sh, step
# `http_padded`) and that figure decides whether CUDA's default changes. Where the packed
# kernels cannot be captured (float32, --gdn-prefill torch), assembly falls back to padded.
DEFAULT_LAYOUT = {"cpu": PER_GROUP, "cuda": PACKED}


def _on_cuda(device: str) -> bool:
    return device.startswith("cuda")


def default_max_sequences(device: str) -> int:
    """`--max-batch 0` for a worker on `device`."""
    return DEFAULT_MAX_BATCH_CUDA if _on_cuda(device) else DEFAULT_MAX_BATCH_CPU


def default_max_batch_tokens(device: str) -> int:
    """`--max-batch-tokens 0` for a worker on `device` (chosen by measurement,
    docs/benchmarks.md); the front never computes it: it reads the budget from `ready`."""
    return DEFAULT_MAX_BATCH_TOKENS_CPU if device.startswith("cpu") else DEFAULT_MAX_BATCH_TOKENS


def default_layout(device: str) -> str:
    """`--batch-layout auto` for a worker on `device`."""
    return DEFAULT_LAYOUT["cuda" if _on_cuda(device) else "cpu"]


def padding_waste(lengths: Sequence[int]) -> float:
    """The share of a padded batch's tokens (rows x longest) that would be pad."""
    if not lengths:
        return 0.0
    return 1.0 - sum(lengths) / (len(lengths) * max(lengths))


def group_layout(layout: str, lengths: Sequence[int]) -> str:
    """The layout one group of requests of these lengths runs in: PER_GROUP's choice
    (padded when it wastes at most MAX_PADDED_WASTE, else packed), or the fixed layout."""
    if layout != PER_GROUP:
        return layout
    return PADDED if padding_waste(lengths) <= MAX_PADDED_WASTE else PACKED


class BatchFlags(Protocol):
    """The worker flags a policy is resolved from (the parsed arguments, or an executor's
    settings that carry them under the same names)."""

    @property
    def batch_layout(self) -> str: ...

    @property
    def max_batch_tokens(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    @property
    def batch_window_ms(self) -> float: ...


@dataclass(frozen=True)
class DefaultFlags:
    """The flags' own defaults (`auto` / 0: by device), for a loader called without flags."""

    batch_layout: str = "auto"
    max_batch_tokens: int = 0
    max_batch: int = 0
    batch_window_ms: float = 0.0


DEFAULT_FLAGS = DefaultFlags()


@dataclass(frozen=True)
class BatchPolicy:
    """How much the worker puts into one forward, how it lays it out, and how long it waits
    for company. The defaults are CUDA's (tests build policies directly)."""

    layout: str = PACKED
    # Tokens per forward: real tokens when packed (back to back also when graphs replay
    # them, clef_worker.serving.gpu.packed_graphs), rows x bucket length when padded.
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_sequences: int = DEFAULT_MAX_BATCH_CUDA  # requests per forward
    window_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"batch layout {self.layout!r}: expected one of {', '.join(LAYOUTS)}")
        if self.max_batch_tokens < 1 or self.max_sequences < 1 or self.window_ms < 0:
            raise ValueError(f"bad batch policy: {self}")

    @classmethod
    def resolve(cls, device: str, *, layout: str = "auto", max_batch_tokens: int = 0,
                max_sequences: int = 0, window_ms: float = 0.0) -> BatchPolicy:
        """The policy for a worker on `device` from its flags (`auto` / 0: by device)."""
        if layout not in BATCH_LAYOUTS:
            raise ValueError(f"--batch-layout {layout}: expected one of {', '.join(BATCH_LAYOUTS)}")
        return cls(
            layout=default_layout(device) if layout == "auto" else layout,
            max_batch_tokens=max_batch_tokens or default_max_batch_tokens(device),
            max_sequences=max_sequences or default_max_sequences(device),
            window_ms=window_ms,
        )

    @classmethod
    def from_flags(cls, device: str, flags: BatchFlags) -> BatchPolicy:
        """The policy the worker's flags ask for on `device`: what each executor calls once,
        at load, where it knows its device (clef_worker.assembly, clef_worker.release)."""
        return cls.resolve(device, layout=flags.batch_layout,
                           max_batch_tokens=flags.max_batch_tokens,
                           max_sequences=flags.max_batch, window_ms=flags.batch_window_ms)

    @property
    def packed(self) -> bool:
        return self.layout == PACKED

    def ready_fields(self) -> dict[str, object]:
        """The policy as `ready` reports it (clef_protocol.messages.ReadyInfo)."""
        return {"batch_layout": self.layout, "max_batch_tokens": self.max_batch_tokens,
                "max_sequences": self.max_sequences, "batch_window_ms": self.window_ms}

"""Replacing a function that transformers' Qwen3.5 module looks up at call time.

Why this exists: `Qwen3_5GatedDeltaNet.forward` reads its kernels (`torch_chunk_gated_delta_rule`,
`causal_conv1d_fn`) from its module's globals on every call, so putting another function there
is how this project chooses a kernel after transformers has bound its own. Two kernels do it
(`clef_worker.model.gated_delta` on CPU, `clef_worker.model.short_conv` on CUDA), and both need
the same three guarantees, kept here once:

- a replacement is built around the function transformers bound (`make(original)`), never around
  an earlier replacement, so replacing again replaces instead of wrapping;
- the replaced function stays reachable (`original`), so it can be restored and so calls a
  replacement does not cover can go to it;
- which global is a replacement can be read back (`replacement`), for the `ready` report.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")

# Set on every replacement: the function it replaced (transformers' own).
REPLACED = "clef_replaced"


def original(module: ModuleType, name: str) -> Any:
    """The function transformers bound as `module.name`, whether or not it is replaced now."""
    current = getattr(module, name)
    return getattr(current, REPLACED, current)


def replacement(module: ModuleType, name: str) -> Any | None:
    """The replacement bound as `module.name`, or None when transformers' own function is."""
    current = getattr(module, name, None)
    return current if hasattr(current, REPLACED) else None


def replace(module: ModuleType, name: str, make: Callable[[Callable[..., Any]], T]) -> T:
    """Bind `make(original)` as `module.name` (process-wide) and return it."""
    base = original(module, name)
    new = make(base)
    setattr(new, REPLACED, base)
    setattr(module, name, new)
    return new


def restore(module: ModuleType, name: str) -> None:
    """Bind transformers' own function again (a no-op when it is bound)."""
    setattr(module, name, original(module, name))

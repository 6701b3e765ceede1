"""clef_worker.model.swap: replacing a module global replaces, never wraps, and can be undone."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from clef_worker.model import swap


def library() -> types.ModuleType:
    """A module standing in for transformers' Qwen3.5 module, with one kernel global."""
    module = types.ModuleType("library")

    def kernel(x: int) -> tuple[str, int]:
        return ("library", x)

    module.kernel = kernel  # type: ignore[attr-defined]
    return module


def wrapping(tag: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A replacement that answers `(tag, what the replaced function answers)`."""

    def make(base: Callable[..., Any]) -> Callable[..., Any]:
        return lambda x: (tag, base(x))

    return make


class Adapter:
    """A callable object as a replacement (the shape of the short-convolution adapter)."""

    def __init__(self, base: Callable[..., Any]) -> None:
        self.base = base

    def __call__(self, x: int) -> tuple[str, Any]:
        return ("adapter", self.base(x))


def test_replace_binds_the_replacement_around_the_library_function() -> None:
    module = library()
    own = module.kernel
    bound = swap.replace(module, "kernel", wrapping("ours"))
    assert module.kernel is bound
    assert module.kernel(3) == ("ours", ("library", 3))
    assert swap.original(module, "kernel") is own
    assert swap.replacement(module, "kernel") is bound


def test_replacing_again_replaces_instead_of_wrapping() -> None:
    module = library()
    swap.replace(module, "kernel", wrapping("first"))
    swap.replace(module, "kernel", wrapping("second"))
    assert module.kernel(1) == ("second", ("library", 1))  # not ("second", ("first", ...))
    swap.replace(module, "kernel", Adapter)
    assert module.kernel(2) == ("adapter", ("library", 2))
    assert isinstance(swap.replacement(module, "kernel"), Adapter)


def test_restore_binds_the_library_function_again() -> None:
    module = library()
    own = module.kernel
    swap.restore(module, "kernel")  # nothing replaced: a no-op
    assert module.kernel is own and swap.replacement(module, "kernel") is None
    swap.replace(module, "kernel", wrapping("ours"))
    swap.replace(module, "kernel", wrapping("again"))
    swap.restore(module, "kernel")
    assert module.kernel is own and module.kernel(4) == ("library", 4)
    assert swap.replacement(module, "kernel") is None


def test_a_missing_global_is_no_replacement() -> None:
    assert swap.replacement(library(), "absent") is None

"""Helpers of the prefix-cache test modules (tests/test_prefix_cache.py,
tests/test_prefix_graphed.py): a state of numbered events, and a request's uncached answer."""

from __future__ import annotations

from typing import Any

from clef_worker.native import NativeExecutor, Prepared
from clef_worker.starting.variant_probe import reference_runner


def events(count: int, tag: str = "") -> dict[str, Any]:
    """A JSON state of `count` distinct events (`tag` makes two such states differ)."""
    return {"events": [{"n": i, "note": f"{tag}invoice {i * 37} paid by {i % 11}"}
                       for i in range(count)]}


def uncached_probabilities(executor: NativeExecutor, prepared: Prepared) -> list[float]:
    """The uncached answer: the plain eager forward of the request alone (no prefix cache)."""
    with reference_runner(executor.runner) as plain:
        assert plain.prefix_cache is None
        return plain.run([prepared.encoding], slots=[prepared.slot]).rows[0].probabilities

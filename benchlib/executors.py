"""Test and benchmark helpers over a loaded native executor (never used when serving)."""

from __future__ import annotations

from clef_protocol.options import RequestLimits
from clef_worker.native import NativeExecutor


def with_limits(executor: NativeExecutor, limits: RequestLimits) -> NativeExecutor:
    """The same loaded model under other request limits: the golden file mixes `max_length`s,
    a worker has one, and the forward does not care."""
    limited = NativeExecutor(snapshot=executor.snapshot, encoder=executor.encoder,
                             runner=executor.runner, limits=limits,
                             short_conv=executor.short_conv, policy=executor.policy,
                             variants=list(executor.variants.values()))
    limited.kernel_cache = executor.kernel_cache
    return limited

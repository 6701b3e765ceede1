"""The warm-up: the whole sequence the native executor runs before `ready` (`warm_native`),
over the requests `clef_worker.starting.warm_requests` derives from the worker's limits.

The sequence (`warm_native`), in order, and why each step:

1. build every graph shape (clef_worker.serving.gpu): the only time shapes are captured; each
capture
   warms its own shape first (Triton autotuning on a side stream);
2. one forward of the warm-up request (a replay where graphs hold it): the head, the tokenizer
   and the copy paths pay their first-touch costs;
3. only where some admissible request runs eagerly (no graphs, or graphs that stop below
   `--max-length`): one Gated DeltaNet layer per fla autotune length bucket, and for the padded
   layout one per batch size the batcher forms (fla's cumulative sum tunes per batch size), each
   within the token budget, so no pass compiles a variant no request can reach; then the
   forward again. With graphs covering every length, these eager passes would only re-tune
   what the captures tuned, so they are skipped;
4. padded graphs only: every shape replayed once, its time the cost the padded layout's
   batched-vs-sequential choice compares (packed buckets have no such choice: nothing would
   read their times, so they are not replayed);
5. with a vision tower, the same request with an image;
6. with the prefix cache on, a request stored and another reusing its prefix
   (`warm_prefix_cache`): the prefixed forward's kernels (fla's initial- and final-state
   variants on a GPU) are compiled here, once, where the start-up counts them as warm-up, so
   neither the self-check's prefix probe nor, after a restart that keeps the verdict, a
   client's first cache hit pays for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clef_protocol.errors import RequestInvalid
from clef_worker.model.encoding import Encoding
from clef_worker.starting.warm_requests import (
    REPRESENTATIVE,
    WarmTarget,
    candidates,
    choose,
    synthetic_encoding,
    with_image,
)

__all__ = ["REPRESENTATIVE", "WarmTarget", "build_graphs", "candidates", "choose",
           "synthetic_encoding", "warm_native", "warm_prefix_cache", "with_image"]


def warm_native(executor: WarmTarget) -> None:
    """The native executor's whole warm-up sequence (the module docs say why each step)."""
    import logging
    import time

    import torch

    from clef_worker.model.backbone import describe_kernel_lengths
    from clef_worker.serving.gpu.graphs import graph_row_counts
    from clef_worker.serving.runner import warm_row_counts
    from clef_worker.starting import startup_clock

    log = logging.getLogger("clef_worker.starting.warmup")
    started = time.perf_counter()
    limits, runner, policy = executor.limits, executor.runner, executor.policy
    with startup_clock.current().phase("capture_s"):
        build_graphs(executor)
    request = choose(limits, executor.encode)
    if request is not None:
        encoding: Encoding | None = executor.encode(request)
    else:
        log.warning("no request fits --max-length %d (every request will be refused with 422); "
                    "warming up on a %d-token sequence without a request", limits.max_length,
                    limits.max_length)
        encoding = synthetic_encoding(executor.encoder.prefix_ids, limits.max_length)
    if encoding is None:
        log.warning("--max-length %d is too short to warm anything up", limits.max_length)
        return
    runner.run([encoding])
    graphs = runner.graphs
    covered = graphs is not None and graphs.graphs and graphs.covers(limits.max_length)
    lengths = [] if covered else describe_kernel_lengths(executor.backbone, limits.max_length)
    if lengths:
        counts = () if runner.packed else graph_row_counts(policy.max_sequences)
        log.info("warming fla kernels for %d length buckets: %s, and batch sizes %s",
                 len(lengths), lengths, list(counts))
        with torch.inference_mode():
            executor.backbone.warm_gdn(lengths)
        for rows in counts:
            length = min(lengths[0], policy.max_batch_tokens // rows)
            if length >= 1:
                warm_row_counts(executor.backbone, [rows], length)
        runner.run([encoding])
    elif covered:
        log.info("graphs hold every length up to --max-length %d: no eager kernel warm-up",
                 limits.max_length)
    if runner.graphs is not None and not runner.packed:  # the padded plan reads the costs
        costs = runner.graphs.replay_all()
        log.info("replayed %d shapes once; replay ms: %s", len(costs),
                 {str(shape): round(ms, 2) for shape, ms in sorted(costs.items())})
    if executor.vision is not None and request is not None:
        try:
            executor.score(with_image(request))
        except RequestInvalid as exc:
            log.warning("image warm-up skipped: %s", exc)
    warm_prefix_cache(executor)
    log.info("warm-up done in %.0f ms (%d tokens)", (time.perf_counter() - started) * 1000,
             encoding.length)


def warm_prefix_cache(executor: WarmTarget) -> bool:
    """Step 6 (module docs): the self-check's prefix-probe pair (clef_worker.starting.prefix_probe)
    run once, storing then reusing, and the cache emptied; whether it ran (not without a cache, with
    it off, or under limits too short for a cached block)."""
    from clef_worker.starting.prefix_probe import probe_requests

    cache = executor.runner.prefix_cache
    if cache is None or not cache.enabled:
        return False
    requests = probe_requests(executor)
    if requests is None:
        return False
    warm, cached, _ = requests
    try:
        for encoding in (warm, cached):
            executor.runner.run([encoding], cache_keys=[executor.prefix_key(encoding)])
    finally:
        cache.clear()
    return True


def build_graphs(executor: WarmTarget,
                 device_usable: Callable[[Any], bool] | None = None) -> None:
    """Build (capture) every shape of the executor's graph runner: the only time shapes are.

    When recording CUDA graphs fails, torch raises `torch.AcceleratorError` for a CUDA
    error (a kernel that launches something capture forbids, or syncs with the host, fails
    with `cudaErrorStreamCaptureUnsupported` / `...Invalidated`) and ordinary exceptions
    (RuntimeError, ...) for checks of its own. Either way, if the device still works
    (`device_usable`: a synchronisation succeeds) the executor serves eagerly and unpadded,
    logs the failure at ERROR and says so in `ready` / `/health` (`cuda_graphs` false,
    `captured_shapes` empty while `graph_shapes` lists the planned shapes), so a bench
    asserting every shape was captured fails instead of timing eager forwards as graphs.
    If the device does not work, or the shapes ran eagerly (nothing to fall back from),
    the error stands and the worker does not start.
    """
    import logging

    log = logging.getLogger("clef_worker.starting.warmup")
    runner = executor.runner
    graphs = runner.graphs
    if graphs is None:
        return
    try:
        built = graphs.build_all()
    except Exception as exc:
        usable = device_usable or _device_usable
        if not graphs.graphs or not usable(executor.device):
            raise
        log.error("CUDA graph capture failed after %d of %d shapes, serving eagerly and "
                  "without graphs: %s: %s", len(graphs.stats.built), len(graphs.planned),
                  type(exc).__name__, exc)
        executor.graph_failure = f"{type(exc).__name__}: {exc}"
        executor.planned_shapes = graphs.planned_shapes()
        runner.graphs = None
        return
    log.info("built %d %s shapes (%s) in %.0f ms, graph memory %d bytes", len(built),
             runner.layout, "cuda graphs" if graphs.graphs else "eager",
             graphs.stats.capture_ms, graphs.capturer.memory_bytes())


def _device_usable(device: Any) -> bool:
    """Whether the device still runs work after an error (a sticky CUDA error fails this)."""
    import torch

    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True

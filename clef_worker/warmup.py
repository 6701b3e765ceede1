"""The warm-up: the workload, derived from the limits the worker serves under, and the whole
sequence the native executor runs before `ready` (`warm_native`).

Why derived: a fixed warm-up request can need more tokens (or questions, options, levels) than
`--max-length` and the other limits allow, and the worker then refused to start although every
request it would refuse is just a 422. So the warm-up is the richest of a few candidate
requests that the worker itself would accept under its limits, trimmed to them; when none fits
(a `--max-length` below any schema's fixed tokens), the caller warms what it can without a
request. Both executors take their warm-up from here, so there is one warm-up request.

The sequence (`warm_native`), in order, and why each step:

1. build every graph shape (clef_worker.gpu): the only time shapes are captured; each capture
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

import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from itertools import cycle, islice
from typing import TYPE_CHECKING, Any, Protocol

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import gradient_image, png_data_uri
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker.model.encoding import TYPE_IDS, EncodedQuestion, Encoding

if TYPE_CHECKING:
    import torch

    from clef_worker.media.vision import PreparedMedia, VisionTower
    from clef_worker.model.backbone import Backbone
    from clef_worker.model.encoding import Encoder
    from clef_worker.policy import BatchPolicy
    from clef_worker.prefix_cache import CacheKey
    from clef_worker.runner import ModelRunner


class WarmTarget(Protocol):
    """What the warm-up needs of an executor (clef_worker.native.NativeExecutor has it); a
    protocol, so this module and the executor that calls it need not import each other."""

    limits: RequestLimits
    runner: ModelRunner
    policy: BatchPolicy
    encoder: Encoder
    graph_failure: str
    planned_shapes: list[list[int]]

    @property
    def backbone(self) -> Backbone: ...

    @property
    def vision(self) -> VisionTower | None: ...

    @property
    def device(self) -> torch.device: ...

    def encode(self, request: dict[str, Any]) -> Encoding: ...

    def score(self, request: dict[str, Any]) -> object: ...

    def prefix_key(self, encoding: Encoding, media: PreparedMedia | None = None,
                   slot: int = 0) -> CacheKey | None:
        """The prefix-cache key the serve loop gives such a request (the self-check's `prefix`
        probe keys its requests with it)."""
        ...

# The richest candidate: ~250 tokens of state and the three question types, like a typical
# small request. The state is truncated to the budget by the encoder like any request's.
REPRESENTATIVE: dict[str, Any] = {
    "model": "warm-up",
    "state": (
        "Ticket 5521: the customer paid invoice #4411 ($12,400) twice by card on 2026-09-30; "
        "the second charge is still pending and the customer asks for a refund of the "
        "duplicate. Earlier messages mention a delayed delivery and a damaged box. "
    ) * 2,
    "questions": {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "topic": {
            "type": "choice",
            "instructions": "What is the ticket about?",
            "criteria": {
                "billing": "Payments, invoices and refunds",
                "delivery": "Shipping and delivery problems",
                "product": "Defects or questions about a product",
                "other": None,
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is the ticket?",
            "criteria": ["none", "low", "medium", "high", "critical"],
        },
    },
}

# Smaller schemas, richest first: the three types bare, then each type alone with the fewest
# schema tokens it can have (a noul question whose option descriptions are dropped).
_BARE: dict[str, dict[str, Any]] = {
    "c": {"type": "choice", "criteria": {"a": None, "b": None}},
    "s": {"type": "score", "criteria": [None, None]},
    "n": {"type": "noul", "criteria": {"true": None, "false": None}},
}


def candidates(limits: RequestLimits) -> Iterator[dict[str, Any]]:
    """Candidate warm-up requests, richest first, each trimmed to the request-shape limits."""
    schemas = [REPRESENTATIVE["questions"], _BARE, *({qid: q} for qid, q in _BARE.items())]
    for questions in schemas:
        request = copy.deepcopy(REPRESENTATIVE)
        request["questions"] = _trimmed(questions, limits)
        yield request


def choose(limits: RequestLimits, encode: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    """The first candidate that validates and that `encode` accepts (it raises RequestInvalid
    when the schema needs more tokens than `limits.max_length`); None when none fits."""
    for request in candidates(limits):
        try:
            validate_request(request, limits)
            encode(request)
        except RequestInvalid:
            continue
        return request
    return None


@functools.cache
def _image_uri() -> str:
    """The warm-up's picture as a data URI, encoded once (the warm-up and the self-check's
    prefix probe send it with every candidate they try)."""
    return png_data_uri(gradient_image(512, 512))


def with_image(request: dict[str, Any]) -> dict[str, Any]:
    """The request with one 512x512 PNG, the size clients send (warms the vision tower)."""
    return {**request, "images": [_image_uri()]}


def synthetic_encoding(filler: Sequence[int], length: int) -> Encoding | None:
    """A `length`-token sequence with one two-option noul question on its first three tokens.

    For a `--max-length` too short for any request: the backbone and head still run once on a
    sequence of the longest admissible length, so their first-touch costs are paid before
    `ready`. `filler` gives the token ids (cycled). None below 3 tokens (no room for a question
    and two options), where there is nothing worth warming.
    """
    if length < 3 or not filler:
        return None
    question = EncodedQuestion(
        id="warm-up", type="noul", type_id=TYPE_IDS["noul"], question_span=(0, 1),
        option_ids=("true", "false"), option_spans=((1, 2), (2, 3)),
    )
    ids = list(islice(cycle(filler), length))
    return Encoding(input_ids=ids, questions=(question,), state_tokens=0)


def _trimmed(questions: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    """At most `max_questions` questions, `max_choice_options` options, `max_score_levels`."""
    kept: dict[str, Any] = {}
    for qid, question in islice(questions.items(), limits.max_questions):
        question = copy.deepcopy(question)
        criteria = question.get("criteria")
        if question["type"] == "choice":
            question["criteria"] = dict(islice(criteria.items(), limits.max_choice_options))
        elif question["type"] == "score":
            question["criteria"] = criteria[: limits.max_score_levels]
        kept[qid] = question
    return kept


def warm_native(executor: WarmTarget) -> None:
    """The native executor's whole warm-up sequence (the module docs say why each step)."""
    import logging
    import time

    import torch

    from clef_worker import startup_clock
    from clef_worker.gpu.graphs import graph_row_counts
    from clef_worker.model.backbone import describe_kernel_lengths
    from clef_worker.runner import warm_row_counts

    log = logging.getLogger("clef_worker.warmup")
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
    """Step 6 (module docs): the self-check's prefix-probe pair (clef_worker.prefix_check) run
    once, storing then reusing, and the cache emptied; whether it ran (not without a cache, with
    it off, or under limits too short for a cached block)."""
    from clef_worker.prefix_check import probe_requests

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

    log = logging.getLogger("clef_worker.warmup")
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

"""The native executor: this project's implementation of the Clef release (spec §§1-5).

`NativeExecutor.load` checks the snapshot, chooses and enforces the Gated DeltaNet kernel before
transformers binds it, loads the text stack, lexical table, tokenizer and head onto one device;
`answer` turns a raw body into the final response bytes; `score` exposes the intermediate values
(token ids, spans, logits, probabilities) for tests, benchmarks and comparisons. The executor is
thin: it parses, validates and encodes requests and builds replies; the model itself runs in a
`clef_worker.runner.ModelRunner` (host tensors, packed copy, hidden rows, head). Everything runs
on the calling thread under `torch.inference_mode()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clef_protocol.body import parse_body
from clef_protocol.errors import RequestInvalid
from clef_protocol.media import decode_media, has_media
from clef_protocol.messages import ModelInfo
from clef_protocol.options import RequestLimits, default_max_batch_tokens
from clef_protocol.validation import validate_request
from clef_worker import warmup
from clef_worker.errors import (
    StartupError,
    broken_device_is_fatal,
)
from clef_worker.executor import Answer
from clef_worker.gpu.buckets import BucketTable
from clef_worker.gpu.graphs import (
    CudaGraphCapturer,
    EagerCapturer,
    GraphRunner,
    buckets_enabled,
    graph_row_counts,
    graphs_enabled,
    pad_token_id,
    plan_shapes,
    prepare_capture_environment,
)
from clef_worker.gpu.kernel_cache import prepare_kernel_cache
from clef_worker.media.vision import PreparedMedia, VisionTower, has_vision, load_vision
from clef_worker.model.answers import build_response, serialize
from clef_worker.model.backbone import (
    DTYPE_NAMES,
    Backbone,
    bind_gdn_path,
    describe_kernel_lengths,
    load_backbone,
    read_tensors,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.encoding import Encoder, Encoding
from clef_worker.model.head import JointSchemaHead
from clef_worker.model.short_conv import TORCH_PATH, bind_short_conv
from clef_worker.model.snapshot import Snapshot, open_snapshot
from clef_worker.runner import ModelRunner, warm_row_counts
from clef_worker.versions import package_version, package_versions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scored:
    """One request's intermediate values; logits and probabilities are per option, in question
    order then encode order (float32 values as Python floats)."""

    request: dict[str, Any]
    encoding: Encoding
    logits: list[float]
    probabilities: list[float]
    timings_ms: dict[str, float] = field(default_factory=dict)
    media: PreparedMedia | None = None

    def response(self) -> dict[str, Any]:
        """The response object for this request."""
        return build_response(self.request, self.encoding, self.probabilities)


@dataclass(frozen=True)
class Prepared:
    """A parsed, validated and encoded request, waiting for its forward (clef_worker.batching)."""

    request: dict[str, Any]
    encoding: Encoding
    media: PreparedMedia | None = None


class NativeExecutor:
    """Implements `clef_worker.executor.Executor` (and `clef_worker.batching.BatchingExecutor`)
    with this project's code: request bodies in, response bytes out; the model runs in its
    `ModelRunner` (clef_worker.runner)."""

    def __init__(
        self,
        *,
        snapshot: Snapshot,
        encoder: Encoder,
        runner: ModelRunner,
        limits: RequestLimits,
        short_conv: str = TORCH_PATH,
        row_counts: Sequence[int] = (1,),
    ):
        self.snapshot = snapshot
        self.encoder = encoder
        self.runner = runner
        self.limits = limits
        self.short_conv = short_conv
        self.row_counts = tuple(row_counts)  # batch sizes the fla kernels are warmed for
        self.graph_failure = ""  # why capture failed at warm-up (the worker then runs eagerly)
        self.kernel_cache = ""  # warm / cold: the on-disk kernel cache at load (CUDA only)
        self._planned_shapes: list[list[int]] = []

    # The loaded model's parts, for tests, benchmarks and comparisons.
    @property
    def backbone(self) -> Backbone:
        return self.runner.backbone

    @property
    def head(self) -> JointSchemaHead:
        return self.runner.head

    @property
    def vision(self) -> VisionTower | None:
        return self.runner.vision

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def pad_id(self) -> int:
        return self.runner.pad_id

    @classmethod
    def from_parts(cls, *, snapshot: Snapshot, encoder: Encoder, backbone: Backbone,
                   head: JointSchemaHead, limits: RequestLimits, short_conv: str = TORCH_PATH,
                   vision: VisionTower | None = None,
                   graphs: GraphRunner | None = None) -> NativeExecutor:
        """An executor over parts loaded or built elsewhere (benchmarks of model shapes that
        have no snapshot); the pad id comes from the snapshot's tokenizer, as `load` takes it."""
        pad_id = graphs.pad_id if graphs is not None else pad_token_id(
            encoder.tokenizer.token_to_id("<|endoftext|>"), snapshot.text_config)
        return cls(snapshot=snapshot, encoder=encoder, limits=limits, short_conv=short_conv,
                   runner=ModelRunner(backbone, head, pad_id, vision, graphs),
                   row_counts=graph_row_counts())

    @classmethod
    def load(
        cls,
        snapshot_dir: Path | str,
        *,
        variant: str = "clef-flash",
        device: str = "auto",
        dtype: str = "auto",
        gdn_prefill: str = "auto",
        short_conv: str = "auto",
        limits: RequestLimits | None = None,
        demo: bool = False,
        media: str = "auto",
        cuda_graphs: str = "auto",
        graph_max_length: int = 0,
        max_batch_tokens: int = 0,
    ) -> NativeExecutor:
        """Check and load a snapshot; StartupError says what is wrong (file, tensor, flag).

        Must run before anything imports transformers' Qwen3.5 modelling module in this process
        (that import binds the Gated DeltaNet kernel; see clef_worker.model.backbone).
        `max_batch_tokens` (0: by device) bounds the batched shapes built at warm-up.
        """
        started = time.perf_counter()
        limits = limits or RequestLimits()
        snapshot = open_snapshot(snapshot_dir, variant=variant, demo=demo)
        target = resolve_device(device)
        weights_dtype = resolve_dtype(dtype, target)
        try:
            capture = graphs_enabled(cuda_graphs, target)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if capture:
            prepare_capture_environment()
        kernels = prepare_kernel_cache() if target.type == "cuda" else None
        gdn_path = bind_gdn_path(gdn_prefill, target, weights_dtype)
        conv_path = bind_short_conv(target, gdn_path, short_conv)
        try:
            encoder = Encoder.from_file(snapshot.tokenizer_file)
        except Exception as exc:
            raise StartupError(f"{snapshot.tokenizer_file}: cannot load the tokenizer: {exc}") \
                from exc
        backbone = load_backbone(snapshot, target, weights_dtype, gdn_path)
        # The release runs the head in the backbone dtype on GPU; on CPU it runs in float32.
        head_dtype = weights_dtype if target.type == "cuda" else torch.float32
        head = load_head(snapshot, target, head_dtype)
        vision = _load_media(snapshot, encoder, backbone, media)
        pad_id = pad_token_id(encoder.tokenizer.token_to_id("<|endoftext|>"),
                              snapshot.text_config)
        budget = max_batch_tokens or default_max_batch_tokens(str(target))
        graphs = None
        if buckets_enabled(cuda_graphs, target):
            table = BucketTable.for_budget(limits.max_length, graph_max_length or None)
            capturer = CudaGraphCapturer(target) if capture else EagerCapturer()
            graphs = GraphRunner(backbone, table, pad_id, capturer,
                                 plan_shapes(table, budget))
        runner = ModelRunner(backbone, head, pad_id, vision, graphs)
        executor = cls(snapshot=snapshot, encoder=encoder, runner=runner, limits=limits,
                       short_conv=conv_path, row_counts=graph_row_counts())
        executor.kernel_cache = kernels.state if kernels is not None else ""
        log.info(
            "loaded %s from %s on %s (%s backbone, %s head, gdn %s) in %.1f s",
            variant, snapshot.root, target, DTYPE_NAMES[weights_dtype],
            DTYPE_NAMES[head_dtype], gdn_path, time.perf_counter() - started,
        )
        return executor

    def with_limits(self, limits: RequestLimits) -> NativeExecutor:
        """The same loaded model under other request limits (tests, benchmarks)."""
        limited = type(self)(snapshot=self.snapshot, encoder=self.encoder, runner=self.runner,
                             limits=limits, short_conv=self.short_conv,
                             row_counts=self.row_counts)
        limited.kernel_cache = self.kernel_cache
        return limited

    # -- Executor protocol -------------------------------------------------------------------

    def describe(self) -> ModelInfo:
        versions = package_versions()
        if self.backbone.gdn_path == "fla":
            versions["fla"] = package_version("fla-core")
        graphs = self.runner.graphs
        if graphs is not None:
            shapes = graphs.describe()
        elif self.graph_failure:  # planned, none serving: benches see the shapes were lost
            shapes = {"graph_shapes": self._planned_shapes}
        else:
            shapes = {}
        return ModelInfo(
            model=self.snapshot.variant,
            variant=self.snapshot.variant,
            device=str(self.device),
            dtype=DTYPE_NAMES[self.backbone.dtype],
            gdn_path=self.backbone.gdn_path,
            short_conv=self.short_conv,
            versions=versions,
            demo=self.snapshot.random,
            snapshot=str(self.snapshot.root),
            kernel_cache=self.kernel_cache,
            **shapes,
        )

    def warm_up(self) -> None:
        """Build every graph shape (the only time shapes are captured), then a forward of the
        richest warm-up request the limits admit (clef_worker.warmup); on the fla path, also one
        Gated DeltaNet layer per autotune length bucket up to --max-length (see
        clef_worker.model.backbone) and per batch size the batcher forms; then replay every
        graph once (first hits are clean, and the replay times become the costs the batched-vs-
        sequential choice compares); with a vision tower, the same request with an image."""
        started = time.perf_counter()
        if self.runner.graphs is not None:
            self._build_graphs(self.runner.graphs)
        request = warmup.choose(self.limits, self.encode)
        encoding = self._warmup_encoding(request)
        if encoding is None:
            log.warning("--max-length %d is too short to warm anything up",
                        self.limits.max_length)
            return
        self.forward(encoding)
        lengths = describe_kernel_lengths(self.backbone, self.limits.max_length)
        if lengths:
            log.info("warming fla kernels for %d length buckets: %s, and batch sizes %s",
                     len(lengths), lengths, list(self.row_counts))
            with torch.inference_mode():
                self.backbone.warm_gdn(lengths)
            warm_row_counts(self.backbone, self.row_counts, lengths[0])
            self.forward(encoding)
        if self.runner.graphs is not None:
            costs = self.runner.graphs.replay_all()
            log.info("replayed %d shapes once; replay ms by [rows, tokens]: %s", len(costs),
                     {f"{r}x{t}": round(ms, 2) for (r, t), ms in sorted(costs.items())})
        if self.vision is not None and request is not None:
            self._warm_media(request)
        log.info("warm-up done in %.0f ms (%d tokens)", (time.perf_counter() - started) * 1000,
                 encoding.length)

    def _build_graphs(self, graphs: GraphRunner,
                      device_usable: Callable[[torch.device], bool] | None = None) -> None:
        """Build (capture) every shape.

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
        try:
            built = graphs.build_all()
        except Exception as exc:
            usable = device_usable or _device_usable
            if not graphs.graphs or not usable(self.device):
                raise
            log.error("CUDA graph capture failed after %d of %d shapes, serving eagerly and "
                      "without graphs: %s: %s", len(graphs.stats.built), len(graphs.planned),
                      type(exc).__name__, exc)
            self.graph_failure = f"{type(exc).__name__}: {exc}"
            self._planned_shapes = [list(shape) for shape in sorted(graphs.planned)]
            self.runner.graphs = None
            return
        log.info("built %d shapes [rows, tokens] (%s) in %.0f ms, graph memory %d bytes",
                 len(built), "cuda graphs" if graphs.graphs else "eager",
                 graphs.stats.capture_ms, graphs.capturer.memory_bytes())

    def _warmup_encoding(self, request: dict[str, Any] | None) -> Encoding | None:
        if request is not None:
            return self.encode(request)
        length = self.limits.max_length
        log.warning(
            "no request fits --max-length %d (every request will be refused with 422); "
            "warming up on a %d-token sequence without a request", length, length,
        )
        return warmup.synthetic_encoding(self.encoder.prefix_ids, length)

    def _warm_media(self, request: dict[str, Any]) -> None:
        """The warm-up request with an image, so the vision tower's first request is not a
        cold one (skipped when the image's tokens do not fit the limits)."""
        try:
            self.score(warmup.with_image(request))
        except RequestInvalid as exc:
            log.warning("image warm-up skipped: %s", exc)

    def answer(self, body: bytes) -> Answer:
        """Raw body -> final response bytes, with the sequence length and state tokens cut.

        Raises `BadRequestBody` (400) for a body that is not an acceptable JSON object and
        `RequestInvalid` (422) for a request the model must refuse; the front has run both
        checks already, the worker repeats them because it trusts no input.
        """
        return self.answer_prepared([self.prepare(body)])[0]

    # -- Inspectable pipeline -------------------------------------------------------------

    def encode(self, request: dict[str, Any], media: PreparedMedia | None = None) -> Encoding:
        """Validate and encode (the budget check raises RequestInvalid); `media`'s tokens go
        right after the prefix and count in the budget."""
        validate_request(request, self.limits)
        media_ids = media.token_ids if media is not None else ()
        return self.encoder.encode(request, self.limits.max_length, media_ids)

    def prepare_media(self, request: dict[str, Any]) -> PreparedMedia | None:
        """Validate, decode and patchify the request's media; None for a text-only request."""
        if not has_media(request):
            return None
        validate_request(request, self.limits)
        if self.vision is None:
            raise RequestInvalid(NO_VISION)
        return self.vision.prepare(decode_media(request, self.limits))

    def score(self, request: dict[str, Any], *, profile: bool = False) -> Scored:
        """Validate, encode, run backbone and head; with `profile`, each stage's time (media,
        encode, backbone, head) in `timings_ms`."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        media = self.prepare_media(request)
        prepared = time.perf_counter()
        encoding = self.encode(request, media)
        encoded = time.perf_counter()
        stages: dict[str, float] = {}
        logits, probabilities = self.forward(encoding, media, stages)
        if profile:
            timings = {"media": (prepared - started) * 1000, "encode": (encoded - prepared) * 1000,
                       **stages}
        return Scored(request=request, encoding=encoding, logits=logits,
                      probabilities=probabilities, timings_ms=timings, media=media)

    def forward(self, encoding: Encoding, media: PreparedMedia | None = None,
                timings: dict[str, float] | None = None) -> tuple[list[float], list[float]]:
        """Backbone (with the vision tower for media) and head on one encoding: per-option
        logits and probabilities; with `timings`, the backbone's and head's times go there."""
        output = self.runner.run([encoding], [media])
        if timings is not None:
            timings.update(backbone=output.stages["forward_ms"], head=output.stages["head_ms"])
        row = output.rows[0]
        return row.logits, row.probabilities

    def score_batch(self, batch: Sequence[Prepared]) -> tuple[list[Scored], list[int],
                                                              dict[str, float]]:
        """The model runner over several encoded requests (as few forwards as its plan says),
        then the head over all of them in one pass: each request's values, the size of the
        forward that answered it, and the group's stage times."""
        output = self.runner.run([item.encoding for item in batch],
                                 [item.media for item in batch])
        scored = [Scored(request=item.request, encoding=item.encoding, logits=row.logits,
                         probabilities=row.probabilities, media=item.media)
                  for item, row in zip(batch, output.rows, strict=True)]
        return scored, [row.batch_size for row in output.rows], output.stages

    def padded_length(self, length: int) -> int:
        """Row length of a forward whose longest request has `length` tokens."""
        return self.runner.padded_length(length)

    # -- Batching (clef_worker.batching) -------------------------------------------------

    def prepare(self, body: bytes) -> Prepared:
        """Parse, validate and encode one body (400 / 422 exceptions as `answer`)."""
        request = parse_body(body)
        media = self.prepare_media(request)
        return Prepared(request, self.encode(request, media), media)

    def prepared_length(self, prepared: Prepared) -> int:
        return len(prepared.encoding.input_ids)

    def runs_alone(self, prepared: Prepared) -> bool:
        """Media requests run alone: the vision tower runs eagerly and unpadded."""
        return prepared.media is not None

    def answer_prepared(self, batch: Sequence[Prepared]) -> list[Answer]:
        """The batch's forwards; the answers in order."""
        with broken_device_is_fatal(self.device):
            scored, sizes, stages = self.score_batch(batch)
            return [Answer(serialize(item.response()), input_tokens=item.encoding.length,
                           truncated_tokens=item.encoding.truncated_tokens, batch_size=size,
                           stages=stages)
                    for item, size in zip(scored, sizes, strict=True)]


NO_VISION = ("this server's model snapshot has no vision tower or processor: images and videos "
             "cannot be scored")


def _load_media(snapshot: Snapshot, encoder: Encoder, backbone: Backbone,
                mode: str) -> VisionTower | None:
    """The vision tower for `--media auto|on|off` (on: the snapshot must have one)."""
    if mode == "off":
        return None
    missing = has_vision(snapshot)
    if missing is not None:
        if mode == "on":
            raise StartupError(f"--media on: snapshot {snapshot.root} cannot score media "
                               f"({missing})")
        log.info("media off: %s", missing)
        return None
    return load_vision(snapshot, encoder, backbone.device, backbone.dtype)


def _device_usable(device: torch.device) -> bool:
    """Whether the device still runs work after an error (a sticky CUDA error fails this)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
    except Exception:
        return False
    return True


def load_head(snapshot: Snapshot, device: torch.device, dtype: torch.dtype) -> JointSchemaHead:
    """Build the head on meta and assign the release tensors (strict: every name; the snapshot
    check has already refused a head file with missing or extra tensors)."""
    with torch.device("meta"):
        head = JointSchemaHead(snapshot.head_config)
    state = read_tensors(dict.fromkeys(head.state_dict(), snapshot.head_file), device, dtype)
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:
        raise StartupError(f"{snapshot.head_file}: cannot load the head: {exc}") from exc
    head.eval()
    head.requires_grad_(False)
    return head

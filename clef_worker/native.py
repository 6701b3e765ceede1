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
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker import warmup
from clef_worker.errors import (
    StartupError,
    broken_device_is_fatal,
)
from clef_worker.executor import Answer
from clef_worker.gpu.buckets import BucketTable
from clef_worker.gpu.graphs import (
    Capturer,
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
from clef_worker.gpu.packed_graphs import PackedGraphRunner, packed_buckets
from clef_worker.media.vision import PreparedMedia, VisionTower, has_vision, load_vision
from clef_worker.model.answers import build_response, serialize
from clef_worker.model.backbone import (
    DTYPE_NAMES,
    Backbone,
    bind_gdn_path,
    load_backbone,
    read_tensors,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.encoding import Encoder, Encoding
from clef_worker.model.head import JointSchemaHead
from clef_worker.model.short_conv import TORCH_PATH, bind_short_conv
from clef_worker.model.snapshot import Snapshot, open_snapshot
from clef_worker.policy import PADDED, BatchPolicy
from clef_worker.runner import ModelRunner, Staged
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
        policy: BatchPolicy | None = None,
    ):
        self.snapshot = snapshot
        self.encoder = encoder
        self.runner = runner
        self.limits = limits
        self.short_conv = short_conv
        # The batch policy the runner's layout and graph shapes were built for.
        self.policy = policy or BatchPolicy.resolve(str(runner.device), layout=runner.layout)
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
                   runner=ModelRunner(backbone, head, pad_id, vision, graphs))

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
        batch_layout: str = "auto",
        max_batch: int = 0,
        batch_window_ms: float = 0.0,
    ) -> NativeExecutor:
        """Check and load a snapshot; StartupError says what is wrong (file, tensor, flag).

        Must run before anything imports transformers' Qwen3.5 modelling module in this process
        (that import binds the Gated DeltaNet kernel; see clef_worker.model.backbone).
        The batch policy (`batch_layout`, `max_batch_tokens`, `max_batch`, `batch_window_ms`;
        auto / 0: by device) is resolved here once for the loaded device (clef_worker.policy):
        the runner's layout and the graph shapes warm-up builds follow it.
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
        try:
            policy = BatchPolicy.resolve(str(target), layout=batch_layout,
                                         max_batch_tokens=max_batch_tokens,
                                         max_sequences=max_batch, window_ms=batch_window_ms)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        graphs: GraphRunner | PackedGraphRunner | None = None
        if buckets_enabled(cuda_graphs, target):
            capturer: Capturer = CudaGraphCapturer(target) if capture else EagerCapturer()
            graphs = build_graph_runner(backbone, pad_id, capturer, policy, limits.max_length,
                                        graph_max_length)
        runner = ModelRunner(backbone, head, pad_id, vision, graphs, policy.layout)
        executor = cls(snapshot=snapshot, encoder=encoder, runner=runner, limits=limits,
                       short_conv=conv_path, policy=policy)
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
                             limits=limits, short_conv=self.short_conv, policy=self.policy)
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
        """The whole warm-up sequence (clef_worker.warmup.warm_native)."""
        warmup.warm_native(self)

    def build_graphs(self, device_usable: Callable[[torch.device], bool] | None = None) -> None:
        """Build (capture) every shape of the runner's graph runner (warm-up only).

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
        graphs = self.runner.graphs
        if graphs is None:
            return
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
            self._planned_shapes = graphs.planned_shapes()
            self.runner.graphs = None
            return
        log.info("built %d %s shapes (%s) in %.0f ms, graph memory %d bytes", len(built),
                 self.runner.layout, "cuda graphs" if graphs.graphs else "eager",
                 graphs.stats.capture_ms, graphs.capturer.memory_bytes())

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
        return self._decode_media(request)

    def _decode_media(self, request: dict[str, Any]) -> PreparedMedia | None:
        """Decode and patchify an already validated request's media (None: text only)."""
        if not has_media(request):
            return None
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

    # -- Batching (clef_worker.batching) -------------------------------------------------

    def prepare(self, body: bytes) -> Prepared:
        """Parse, validate (once) and encode one body (400 / 422 exceptions as `answer`)."""
        request = parse_body(body)
        validate_request(request, self.limits)
        media = self._decode_media(request)
        media_ids = media.token_ids if media is not None else ()
        return Prepared(request, self.encoder.encode(request, self.limits.max_length, media_ids),
                        media)

    def prepared_length(self, prepared: Prepared) -> int:
        return len(prepared.encoding.input_ids)

    def batch_tokens(self, lengths: Sequence[int]) -> int:
        """A forward's cost against the token budget, in the runner's layout."""
        return self.runner.batch_tokens(lengths)

    def runs_alone(self, prepared: Prepared) -> bool:
        """Media requests run alone: the vision tower runs eagerly and unpadded."""
        return prepared.media is not None

    def stage(self, batch: Sequence[Prepared]) -> tuple[Sequence[Prepared], Staged]:
        """The group's host tensors (helper thread; no CUDA call but pinning)."""
        return batch, self.runner.stage([item.encoding for item in batch],
                                        [item.media for item in batch])

    def answer_staged(self, staged: tuple[Sequence[Prepared], Staged]) -> list[Answer]:
        """The group's forwards on the main thread; the answers in order."""
        batch, host = staged
        with broken_device_is_fatal(self.device):
            output = self.runner.run_staged(host)
            return [Answer(serialize(build_response(item.request, item.encoding,
                                                    row.probabilities)),
                           input_tokens=item.encoding.length,
                           truncated_tokens=item.encoding.truncated_tokens,
                           batch_size=row.batch_size, stages=output.stages)
                    for item, row in zip(batch, output.rows, strict=True)]

    def answer_prepared(self, batch: Sequence[Prepared]) -> list[Answer]:
        """Stage and answer one group on the calling thread."""
        return self.answer_staged(self.stage(batch))


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


def build_graph_runner(backbone: Backbone, pad_id: int, capturer: Capturer, policy: BatchPolicy,
                       max_length: int, graph_max_length: int = 0
                       ) -> GraphRunner | PackedGraphRunner:
    """The graph runner for the policy's layout, its shapes planned from the policy: packed,
    one per total-token bucket up to the largest forward; padded, `[rows, bucket]` for the
    row counts up to the policy's requests per forward within its token budget."""
    if policy.layout == PADDED:
        table = BucketTable.for_budget(max_length, graph_max_length or None)
        return GraphRunner(backbone, table, pad_id, capturer,
                           plan_shapes(table, policy.max_batch_tokens,
                                       graph_row_counts(policy.max_sequences)))
    buckets = packed_buckets(policy.max_batch_tokens, max_length, graph_max_length)
    return PackedGraphRunner(backbone, buckets, policy.max_sequences, pad_id, capturer)


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

"""The native executor: this project's implementation of the Clef release (spec §§1-5).

`NativeExecutor.load` checks the snapshot, chooses and enforces the Gated DeltaNet kernel before
transformers binds it, loads the text stack, lexical table, tokenizer and head onto one device;
`answer` turns a raw body into the final response bytes; `score` exposes the intermediate values
(token ids, spans, logits, probabilities) for tests, benchmarks and comparisons. Everything runs
on the calling thread under `torch.inference_mode()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from clef_protocol.body import parse_body
from clef_protocol.errors import RequestInvalid
from clef_protocol.media import decode_media, has_media
from clef_protocol.messages import ModelInfo
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker import warmup
from clef_worker.errors import ExecutorBroken, StartupError
from clef_worker.executor import Answer
from clef_worker.gpu.buckets import BucketTable
from clef_worker.gpu.graphs import (
    BucketedBackbone,
    CudaGraphCapturer,
    EagerCapturer,
    buckets_enabled,
    graphs_enabled,
    pad_token_id,
    prepare_capture_environment,
)
from clef_worker.gpu.transfer import to_device_packed
from clef_worker.media.vision import PreparedMedia, VisionTower, has_vision, load_vision
from clef_worker.model.answers import build_response, serialize
from clef_worker.model.backbone import (
    DTYPE_NAMES,
    Backbone,
    bind_gdn_path,
    describe_kernel_lengths,
    load_backbone,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.encoding import Encoder, Encoding
from clef_worker.model.head import HeadBatch, JointSchemaHead, RecordSpans
from clef_worker.model.short_conv import TORCH_PATH, bind_short_conv
from clef_worker.model.snapshot import Snapshot, open_snapshot
from clef_worker.versions import package_version, package_versions

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    """Implements `clef_worker.executor.Executor` with this project's code."""

    def __init__(
        self,
        *,
        snapshot: Snapshot,
        encoder: Encoder,
        backbone: Backbone,
        head: JointSchemaHead,
        limits: RequestLimits,
        vision: VisionTower | None = None,
        runner: BucketedBackbone | None = None,
        short_conv: str = TORCH_PATH,
    ):
        self.snapshot = snapshot
        self.encoder = encoder
        self.backbone = backbone
        self.head = head
        self.limits = limits
        self.vision = vision
        self.device = backbone.device
        self.runner = runner
        self.short_conv = short_conv
        self.pad_id = runner.pad_id if runner is not None else pad_token_id(
            encoder.tokenizer.token_to_id("<|endoftext|>"), snapshot.text_config)

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
    ) -> NativeExecutor:
        """Check and load a snapshot; StartupError says what is wrong (file, tensor, flag).

        Must run before anything imports transformers' Qwen3.5 modelling module in this process
        (that import binds the Gated DeltaNet kernel; see clef_worker.model.backbone).
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
        runner = None
        if buckets_enabled(cuda_graphs, target):
            table = BucketTable.for_budget(limits.max_length, graph_max_length or None)
            pad_id = pad_token_id(encoder.tokenizer.token_to_id("<|endoftext|>"),
                                  snapshot.text_config)
            capturer = CudaGraphCapturer(target) if capture else EagerCapturer()
            runner = BucketedBackbone(backbone, table, pad_id, capturer, graphs=capture)
        executor = cls(snapshot=snapshot, encoder=encoder, backbone=backbone, head=head,
                       limits=limits, vision=vision, runner=runner, short_conv=conv_path)
        log.info(
            "loaded %s from %s on %s (%s backbone, %s head, gdn %s) in %.1f s",
            variant, snapshot.root, target, DTYPE_NAMES[weights_dtype],
            DTYPE_NAMES[head_dtype], gdn_path, time.perf_counter() - started,
        )
        return executor

    def with_limits(self, limits: RequestLimits) -> NativeExecutor:
        """The same loaded model under other request limits (tests, benchmarks)."""
        return type(self)(snapshot=self.snapshot, encoder=self.encoder, backbone=self.backbone,
                          head=self.head, limits=limits, vision=self.vision,
                          runner=self.runner, short_conv=self.short_conv)

    # -- Executor protocol -------------------------------------------------------------------

    def describe(self) -> ModelInfo:
        versions = package_versions()
        if self.backbone.gdn_path == "fla":
            versions["fla"] = package_version("fla-core")
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
            **(self.runner.describe() if self.runner is not None else {}),
        )

    def warm_up(self) -> None:
        """A forward of the richest warm-up request the limits admit (clef_worker.warmup); on
        the fla path, also one Gated DeltaNet layer per autotune length bucket up to
        --max-length (see clef_worker.model.backbone); with a vision tower, the same request with an
        image."""
        started = time.perf_counter()
        if self.runner is not None:
            self._build_buckets(self.runner)
        request = warmup.choose(self.limits, self.encode)
        encoding = self._warmup_encoding(request)
        if encoding is None:
            log.warning("--max-length %d is too short to warm anything up",
                        self.limits.max_length)
            return
        self.forward(encoding)
        lengths = describe_kernel_lengths(self.backbone, self.limits.max_length)
        if lengths:
            log.info("warming fla kernels for %d length buckets: %s", len(lengths), lengths)
            with torch.inference_mode():
                self.backbone.warm_gdn(lengths)
            self.forward(encoding)
        if self.vision is not None and request is not None:
            self._warm_media(request)
        log.info("warm-up done in %.0f ms (%d tokens)", (time.perf_counter() - started) * 1000,
                 encoding.length)

    def _build_buckets(self, runner: BucketedBackbone) -> None:
        """Build (capture) every bucket. A kernel that cannot be captured must not take the
        service down: the executor then serves eagerly and unpadded, and says so in the log
        and in `ready` / `/health`."""
        try:
            built = runner.capture_all()
        except Exception as exc:
            if not runner.graphs or device_is_broken(exc, self.device):
                raise
            log.error("CUDA graph capture failed, serving without graphs: %s: %s",
                      type(exc).__name__, exc)
            self.runner = None
            return
        log.info("built %d length buckets (%s) in %.0f ms, graph memory %d bytes", len(built),
                 "cuda graphs" if runner.graphs else "eager", runner.stats.capture_ms,
                 runner.capturer.memory_bytes())


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
        """Validate, encode, run backbone and head; with `profile`, time each stage (syncing
        the device between stages, which costs a little)."""
        timings: dict[str, float] = {}
        media = self._timed(timings, "media", profile, lambda: self.prepare_media(request))
        encoding = self._timed(timings, "encode", profile, lambda: self.encode(request, media))
        logits, probabilities = self.forward(encoding, media, timings if profile else None)
        return Scored(request=request, encoding=encoding, logits=logits,
                      probabilities=probabilities, timings_ms=timings, media=media)

    def forward(self, encoding: Encoding, media: PreparedMedia | None = None,
                timings: dict[str, float] | None = None) -> tuple[list[float], list[float]]:
        """Backbone (with the vision tower for media) and head on one encoding: per-option
        logits and probabilities; with `timings`, each stage's time is recorded there."""
        profile = timings is not None
        return self._forward_batch([encoding], [media], {} if timings is None else timings,
                                   profile)[0]

    def score_batch(self, batch: Sequence[Prepared]) -> list[Scored]:
        """One backbone forward over several encoded requests (right-padded rows), then the
        head over all of them (one pass, `HeadBatch`)."""
        results = self._forward_batch([item.encoding for item in batch],
                                      [item.media for item in batch], {}, False)
        return [Scored(request=item.request, encoding=item.encoding, logits=logits,
                       probabilities=probabilities, media=item.media)
                for item, (logits, probabilities) in zip(batch, results, strict=True)]

    def _forward_batch(self, encodings: Sequence[Encoding], medias: Sequence[PreparedMedia | None],
                       timings: dict[str, float],
                       profile: bool) -> list[tuple[list[float], list[float]]]:
        """One backbone forward over right-padded rows, then one head pass over the rows' real
        positions; media requests run alone (vision tower, eager, unpadded)."""
        if len(encodings) > 1 and any(media is not None for media in medias):
            return [self._forward_batch([encoding], [media], {}, False)[0]
                    for encoding, media in zip(encodings, medias, strict=True)]
        lengths = [len(encoding.input_ids) for encoding in encodings]
        width = self.padded_length(max(lengths))
        with torch.inference_mode():
            host_ids = torch.full((len(encodings), width), self.pad_id, dtype=torch.long)
            for row, encoding in enumerate(encodings):
                host_ids[row, :lengths[row]] = torch.tensor(encoding.input_ids, dtype=torch.long)
            real_ids = torch.cat([host_ids[row, :length] for row, length in enumerate(lengths)])
            batch = HeadBatch.build([RecordSpans(
                tokens=length, question_spans=[q.question_span for q in encoding.questions],
                option_spans=[q.option_spans for q in encoding.questions],
                question_types=[q.type_id for q in encoding.questions])
                for encoding, length in zip(encodings, lengths, strict=True)])
            ids, real_ids, batch = self._to_device(host_ids, real_ids, batch)
            rows = self._timed(timings, "backbone", profile,
                               lambda: self._hidden_rows(ids, lengths, medias[0]))
            outputs = self._timed(timings, "head", profile, lambda: self.head.forward_batch(
                rows[0] if len(rows) == 1 else torch.cat(rows), real_ids,
                self.backbone.lexical_table, batch))
            values = torch.cat([torch.stack([o.logits, o.probabilities]) for o in outputs],
                               dim=1).cpu()
        return [(logits.tolist(), probabilities.tolist())
                for logits, probabilities in values.split(list(batch.option_counts), dim=1)]

    def padded_length(self, length: int) -> int:
        """Row length of a forward whose longest request has `length` tokens."""
        return self.runner.padded_length(length) if self.runner is not None else length

    def _hidden_rows(self, ids: torch.Tensor, lengths: list[int],
                     media: PreparedMedia | None) -> list[torch.Tensor]:
        """Each request's real rows of the last hidden state ([T_b, H] each); `media` only
        with a single request."""
        if media is not None and self.vision is not None:
            return [self.vision.hidden_states(self.backbone, ids[0, :lengths[0]], media)]
        if len(lengths) == 1:
            if self.runner is not None:
                return [self.runner.hidden_states(ids[0], lengths[0])]
            return [self.backbone.hidden_states(ids[0, :lengths[0]])]
        hidden = self.backbone.model(input_ids=ids, use_cache=False).last_hidden_state
        return [hidden[row, :length] for row, length in enumerate(lengths)]

    def _to_device(self, host_ids: torch.Tensor, real_ids: torch.Tensor, batch: HeadBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, HeadBatch]:
        """The padded ids, the real ids end to end and every head index tensor in one
        host-to-device copy."""
        moved = to_device_packed([host_ids, real_ids, *batch.tensors()], self.device)
        return moved[0], moved[1], batch.with_tensors(moved[2:])

    # -- Batching (clef_worker.batching) -------------------------------------------------

    def prepare(self, body: bytes) -> Prepared:
        """Parse, validate and encode one body (400 / 422 exceptions as `answer`)."""
        request = parse_body(body)
        media = self.prepare_media(request)
        return Prepared(request, self.encode(request, media), media)

    def prepared_length(self, prepared: Prepared) -> int:
        return len(prepared.encoding.input_ids)

    def answer_prepared(self, batch: Sequence[Prepared]) -> list[Answer]:
        """One forward over the batch; the answers in order."""
        try:
            return [Answer(serialize(scored.response()), input_tokens=scored.encoding.length,
                           truncated_tokens=scored.encoding.truncated_tokens)
                    for scored in self.score_batch(batch)]
        except Exception as exc:
            if device_is_broken(exc, self.device):
                raise ExecutorBroken(f"{type(exc).__name__}: {exc}") from exc
            raise

    def _timed(self, timings: dict[str, float], name: str, profile: bool,
               step: Callable[[], T]) -> T:
        if not profile:
            return step()
        started = time.perf_counter()
        result = step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        timings[name] = (time.perf_counter() - started) * 1000
        return result


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


def device_is_broken(exc: BaseException, device: torch.device) -> bool:
    """Whether an exception means the device context is unusable (sticky CUDA errors).

    Out-of-memory is not: it fails one request and the next may fit. An illegal memory access,
    a device-side assert or a lost device poison the CUDA context for the whole process, and
    every later kernel launch would fail too.
    """
    if device.type != "cuda" or isinstance(exc, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


def load_head(snapshot: Snapshot, device: torch.device, dtype: torch.dtype) -> JointSchemaHead:
    """Build the head on meta and assign the release tensors (strict: every name, no extra)."""
    with torch.device("meta"):
        head = JointSchemaHead(snapshot.head_config)
    target = str(device) if device.type == "cuda" else "cpu"
    try:
        with safe_open(str(snapshot.head_file), framework="pt", device=target) as handle:
            state = {name: handle.get_tensor(name).to(dtype) for name in handle.keys()}  # noqa: SIM118 (not a dict)
        head.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:
        raise StartupError(f"{snapshot.head_file}: cannot load the head: {exc}") from exc
    head.eval()
    head.requires_grad_(False)
    return head

"""The native executor: this project's implementation of the Clef release (spec §§1-5).

`NativeExecutor` is thin: it prepares requests (parse, validate once, encode; host work, which
the serve loop runs on its helper thread), stages a group's host tensors, answers the group
through its `clef_worker.serving.runner.ModelRunner` (one copy, the forwards, the head) and builds
the replies; `score` is its one inspection entry (token ids, spans, logits, probabilities) for
tests,
benchmarks and comparisons. Loading lives in `clef_worker.assembly` (`assemble_snapshot` for
tests and tools), the warm-up sequence in `clef_worker.starting.warmup` (which knows the executor
only as its `WarmTarget` protocol). Device work runs on the calling thread under
`torch.inference_mode()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from clef_protocol.body import parse_body
from clef_protocol.errors import RequestInvalid, UnknownModel
from clef_protocol.media import decode_media, has_media
from clef_protocol.messages import ModelInfo
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request
from clef_worker.errors import (
    broken_device_is_fatal,
)
from clef_worker.media.vision import PreparedMedia, VisionTower
from clef_worker.model.answers import build_response, serialize
from clef_worker.model.backbone import Backbone
from clef_worker.model.encoding import Encoder, Encoding
from clef_worker.model.head import JointSchemaHead
from clef_worker.model.kernel_choice import DTYPE_NAMES
from clef_worker.model.lora import BASE_SLOT
from clef_worker.model.short_conv import TORCH_PATH
from clef_worker.model.snapshot import Snapshot
from clef_worker.serving.executor import Answer
from clef_worker.serving.policy import BatchPolicy
from clef_worker.serving.prefix.cache import CacheKey, root_key
from clef_worker.serving.runner import ModelRunner
from clef_worker.serving.staging import Staged
from clef_worker.starting import warmup
from clef_worker.variants import Variant
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
    """A parsed, validated and encoded request, waiting for its forward
    (clef_worker.serving.batching)."""

    request: dict[str, Any]
    encoding: Encoding
    media: PreparedMedia | None = None
    slot: int = BASE_SLOT  # the fine-tuned variant that scores it (0: the base)


class NativeExecutor:
    """Implements `clef_worker.serving.executor.Executor` (and
    `clef_worker.serving.batching.BatchingExecutor`)
    with this project's code: request bodies in, response bytes out; the model runs in its
    `ModelRunner` (clef_worker.serving.runner)."""

    def __init__(
        self,
        *,
        snapshot: Snapshot,
        encoder: Encoder,
        runner: ModelRunner,
        limits: RequestLimits,
        short_conv: str = TORCH_PATH,
        policy: BatchPolicy,
        variants: Sequence[Variant] = (),
    ):
        self.snapshot = snapshot
        # Fine-tuned variants by model name: a request whose `model` names one is scored by it.
        self.variants = {variant.name: variant for variant in variants}
        self._names = {variant.slot: variant.name for variant in variants}
        # The names the base model answers to: None, any name (no `--finetune`: the body's
        # model is echoed, as the reference does); with `--finetune`, only these
        # (`serve_base_as`), so a variant this worker does not have is refused, never scored
        # by the base.
        self.base_names: frozenset[str] | None = None
        self.encoder = encoder
        self.runner = runner
        self.limits = limits
        self.short_conv = short_conv
        # The batch policy the runner's layout and graph shapes were built for (resolved once,
        # by clef_worker.assembly); the serve loop and `ready` read it here.
        self.policy = policy
        self.graph_failure = ""  # why capture failed at warm-up (the worker then runs eagerly)
        self.kernel_cache = ""  # warm / cold: the on-disk kernel cache at load (CUDA only)
        self.planned_shapes: list[list[int]] = []  # what capture should have built, if it failed

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

    # -- Executor protocol -------------------------------------------------------------------

    def describe(self) -> ModelInfo:
        versions = package_versions()
        if self.backbone.gdn_path == "fla":
            versions["fla"] = package_version("fla-core")
        graphs = self.runner.graphs
        if graphs is not None:
            shapes = graphs.describe()
        elif self.graph_failure:  # planned, none serving: benches see the shapes were lost
            shapes = {"graph_shapes": self.planned_shapes}
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
            finetunes=[variant.describe() for variant in self.variants.values()],
            **shapes,
        )

    def warm_up(self) -> None:
        """The whole warm-up sequence (clef_worker.starting.warmup.warm_native)."""
        warmup.warm_native(self)

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
        cache = self.runner.prefix_cache
        return self.vision.prepare(decode_media(request, self.limits),
                                   digest=cache is not None and cache.enabled)

    def score(self, request: dict[str, Any], *, profile: bool = False) -> Scored:
        """Validate, encode, run backbone and head; with `profile`, each stage's time (media,
        encode, backbone, head) in `timings_ms`."""
        timings: dict[str, float] = {}
        started = time.perf_counter()
        media = self.prepare_media(request)
        prepared = time.perf_counter()
        encoding = self.encode(request, media)
        encoded = time.perf_counter()
        output = self.runner.run([encoding], [media], [self.slot_of(request)])
        if profile:
            timings = {"media": (prepared - started) * 1000, "encode": (encoded - prepared) * 1000,
                       "backbone": output.stages["forward_ms"], "head": output.stages["head_ms"]}
        row = output.rows[0]
        return Scored(request=request, encoding=encoding, logits=row.logits,
                      probabilities=row.probabilities, timings_ms=timings, media=media)

    def serve_base_as(self, names: Sequence[str]) -> None:
        """Score only these names (and the variants) with the base; refuse any other name."""
        self.base_names = frozenset(names)

    def slot_of(self, request: dict[str, Any]) -> int:
        """The slot of the model the request's `model` names: a variant's, the base's for one of
        `base_names` (any name while that is None); UnknownModel (404) for any other name."""
        name = request.get("model")
        variant = self.variants.get(name)  # type: ignore[arg-type]
        if variant is not None:
            return variant.slot
        if self.base_names is None or name in self.base_names:
            return BASE_SLOT
        served = sorted(self.base_names) + list(self.variants)
        raise UnknownModel(f"unknown model {name!r}; this worker serves {', '.join(served)}")

    # -- Batching (clef_worker.serving.batching) -------------------------------------------------

    def prepare(self, body: bytes) -> Prepared:
        """Parse, validate (once) and encode one body (400 / 422 exceptions as `answer`)."""
        request = parse_body(body)
        validate_request(request, self.limits)
        media = self._decode_media(request)
        media_ids = media.token_ids if media is not None else ()
        return Prepared(request, self.encoder.encode(request, self.limits.max_length, media_ids),
                        media, self.slot_of(request))

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
                                        [item.media for item in batch],
                                        [item.slot for item in batch],
                                        [self.cache_key(item) for item in batch])

    def cache_key(self, item: Prepared) -> CacheKey | None:
        """A prepared request's prefix-cache key (`prefix_key`)."""
        return self.prefix_key(item.encoding, item.media, item.slot)

    def prefix_key(self, encoding: Encoding, media: PreparedMedia | None = None,
                   slot: int = 0) -> CacheKey | None:
        """A request's prefix-cache key: its variant (a variant never reuses the base's states),
        its media's digest (two pictures never share states), where its media tokens end (no
        prefix shorter than them is reused) and where its state span ends. None for media
        whose pixels are not named (a worker with the cache off does not hash them)."""
        media_end = len(self.encoder.prefix_ids)
        if media is None:
            return CacheKey(self.cache_root(slot), media_end + encoding.state_tokens)
        if not media.digest:
            return None
        media_end += len(media.token_ids)
        return CacheKey(self.cache_root(slot, media.digest), media_end + encoding.state_tokens,
                        media_end)

    def cache_root(self, slot: int, media_digest: str = "") -> bytes:
        """The root of every prefix-cache chain scored by the variant in `slot` (about the
        media of this digest: "" for text)."""
        variant = next((v.name for v in self.variants.values() if v.slot == slot), "")
        return root_key(f"{slot}:{variant}", media_digest)

    def answer_staged(self, staged: tuple[Sequence[Prepared], Staged]) -> list[Answer]:
        """The group's forwards on the main thread; the answers in order."""
        batch, host = staged
        cache = self.runner.prefix_cache
        with broken_device_is_fatal(self.device):
            output = self.runner.run_staged(host)
            return [Answer(serialize(build_response(item.request, item.encoding,
                                                    row.probabilities)),
                           input_tokens=item.encoding.length,
                           truncated_tokens=item.encoding.truncated_tokens,
                           batch_size=row.batch_size, stages=output.stages,
                           prefix=cache.stats(row.reused_tokens) if cache is not None else None,
                           model=self._names.get(item.slot, ""))
                    for item, row in zip(batch, output.rows, strict=True)]

    def answer_prepared(self, batch: Sequence[Prepared]) -> list[Answer]:
        """Stage and answer one group on the calling thread."""
        return self.answer_staged(self.stage(batch))


NO_VISION = ("this server's model snapshot has no vision tower or processor: images and videos "
             "cannot be scored")

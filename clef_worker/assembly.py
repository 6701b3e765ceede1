"""Assembling the native executor: one settings value in, a loaded executor out.

Why a module of its own: loading is a sequence with an order that matters (the Gated DeltaNet
kernel is chosen and bound before transformers' Qwen3.5 module is imported; the capture
environment is set before fla is imported; the kernel cache is pointed before any kernel
compiles) and it touches every layer (snapshot, tokenizer, backbone, head, vision tower, batch
policy, graph runner, kernel cache). Kept out of `NativeExecutor`, which then only prepares and
answers requests, the sequence reads top to bottom in `assemble`, and its inputs are one frozen
value (`ModelSettings`) instead of a dozen keyword arguments passed along one by one.

`clef_worker.loading` builds the settings from the worker's flags; tests and benchmarks call
`assemble_snapshot(snapshot_dir, **fields)`, which builds them the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clef_protocol.finetune import Finetune
from clef_protocol.options import AUTO, RequestLimits, prefix_cache_capacity
from clef_worker.errors import StartupError
from clef_worker.media.vision import VisionTower, has_vision, load_vision
from clef_worker.model.backbone import Backbone, load_backbone, read_tensors
from clef_worker.model.encoding import Encoder
from clef_worker.model.head import JointSchemaHead
from clef_worker.model.kernel_choice import (
    DTYPE_NAMES,
    bind_gdn_path,
    resolve_device,
    resolve_dtype,
)
from clef_worker.model.lora import SEGMENTS, STACKED, AdapterSelection
from clef_worker.model.packed_layers import kernels_for
from clef_worker.model.short_conv import bind_short_conv
from clef_worker.model.snapshot import Snapshot, open_snapshot
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu.buckets import BucketTable
from clef_worker.serving.gpu.capture import (
    Capturer,
    CudaGraphCapturer,
    EagerCapturer,
    buckets_enabled,
    graphs_enabled,
    prepare_capture_environment,
)
from clef_worker.serving.gpu.graphs import GraphRunner, graph_row_counts, pad_token_id, plan_shapes
from clef_worker.serving.gpu.packed_graphs import PackedGraphRunner, packed_buckets
from clef_worker.serving.policy import PACKED, PADDED, PER_GROUP, BatchPolicy
from clef_worker.serving.prefix.cache import PrefixCache, default_block_tokens, default_store_policy
from clef_worker.serving.runner import ModelRunner
from clef_worker.starting.kernel_cache import key_parts as kernel_key_parts
from clef_worker.starting.kernel_cache import prepare_kernel_cache
from clef_worker.variants import load_variants, refuse_variant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSettings:
    """Everything `assemble` needs, as the worker's flags give it (auto / 0: by device)."""

    snapshot_dir: Path
    variant: str = "clef-flash"
    device: str = "auto"
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    gdn_prefill: str = "auto"
    short_conv: str = "auto"
    limits: RequestLimits = field(default_factory=RequestLimits)
    demo: bool = False  # the snapshot may be the built-in random one
    media: str = "auto"
    cuda_graphs: str = "auto"
    graph_max_length: int = 0  # the largest bucket captured (0: up to --max-length)
    # The batch policy (clef_worker.serving.policy), resolved once for the loaded device.
    batch_layout: str = "auto"
    max_batch_tokens: int = 0
    max_batch: int = 0
    batch_window_ms: float = 0.0
    # Fine-tuned variants served unmerged over this snapshot (`--finetune`).
    finetunes: tuple[Finetune, ...] = ()
    # The names the base answers to (`--served-model-name`, aliases, `--variant`): what a
    # variant's `base_model_name_or_path` may name besides the snapshot (empty: `variant`).
    base_names: tuple[str, ...] = ()
    # The prefix cache (clef_worker.serving.prefix.cache): on or off, and its bound (0: by device).
    prefix_cache: str = "on"
    prefix_cache_bytes: int | str = AUTO  # `--prefix-cache-bytes`: auto (by device) or bytes


def assemble(settings: ModelSettings) -> NativeExecutor:
    """Check and load a snapshot; StartupError says what is wrong (file, tensor, flag).

    Must run before anything imports transformers' Qwen3.5 modelling module in this process
    (that import binds the Gated DeltaNet kernel; see clef_worker.model.backbone).
    """
    started = time.perf_counter()
    limits = settings.limits
    snapshot = open_snapshot(settings.snapshot_dir, variant=settings.variant, demo=settings.demo)
    target = resolve_device(settings.device)
    weights_dtype = resolve_dtype(settings.dtype, target)
    try:
        capture = graphs_enabled(settings.cuda_graphs, target)
        policy = BatchPolicy.from_flags(str(target), settings)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if capture:
        prepare_capture_environment()
    kernels = (prepare_kernel_cache(parts=kernel_key_parts(target, str(weights_dtype),
                                                           snapshot.text_config))
               if target.type == "cuda" else None)
    gdn_path = bind_gdn_path(settings.gdn_prefill, target, weights_dtype)
    conv_path = bind_short_conv(target, gdn_path, settings.short_conv)
    try:
        encoder = Encoder.from_file(snapshot.tokenizer_file)
    except Exception as exc:
        raise StartupError(f"{snapshot.tokenizer_file}: cannot load the tokenizer: {exc}") \
            from exc
    backbone = load_backbone(snapshot, target, weights_dtype, gdn_path)
    # The release runs the head in the backbone dtype on GPU; on CPU it runs in float32.
    head_dtype = weights_dtype if target.type == "cuda" else torch.float32
    head = load_head(snapshot, target, head_dtype)
    vision = load_media(snapshot, encoder, backbone, settings.media)
    selection = AdapterSelection(STACKED if target.type == "cuda" else SEGMENTS)
    variants = load_variants(list(settings.finetunes), backbone, head, selection,
                             settings.base_names or (settings.variant,), snapshot.root,
                             on_refused=refuse_variant)
    pad_id = pad_token_id(encoder.tokenizer.token_to_id("<|endoftext|>"), snapshot.text_config)
    if policy.packed and capture:
        policy = packed_or_padded(backbone, policy, explicit=settings.batch_layout == PACKED)
    buckets = buckets_enabled(settings.cuda_graphs, target)
    if buckets and policy.layout == PER_GROUP:
        # Bucketed shapes are one layout's: CPU's `auto` keeps packed rows, as before it chose
        # per group (clef_worker.serving.policy.group_layout runs only eager forwards).
        policy = dataclasses.replace(policy, layout=PACKED)
    graphs: GraphRunner | PackedGraphRunner | None = None
    if buckets and not (
            policy.packed and capture and not backbone_packs_in_graphs(backbone)):
        capturer: Capturer = CudaGraphCapturer(target) if capture else EagerCapturer()
        graphs = build_graph_runner(backbone, pad_id, capturer, policy, limits.max_length,
                                    settings.graph_max_length,
                                    selection if variants else None)
    runner = ModelRunner(backbone, head, pad_id, vision, graphs, policy.layout,
                         [variant.head for variant in variants],
                         selection if variants else None,
                         PrefixCache(prefix_cache_capacity(settings.prefix_cache_bytes,
                                                           str(target)),
                                     block_tokens=default_block_tokens(str(target)),
                                     enabled=settings.prefix_cache == "on",
                                     policy=default_store_policy(str(target))))
    executor = NativeExecutor(snapshot=snapshot, encoder=encoder, runner=runner, limits=limits,
                              short_conv=conv_path, policy=policy, variants=variants)
    executor.kernel_cache = kernels.state if kernels is not None else ""
    log.info(
        "loaded %s from %s on %s (%s backbone, %s head, gdn %s, %s batches) in %.1f s",
        settings.variant, snapshot.root, target, DTYPE_NAMES[weights_dtype],
        DTYPE_NAMES[head_dtype], gdn_path, policy.layout, time.perf_counter() - started,
    )
    return executor


def backbone_packs_in_graphs(backbone: Backbone) -> bool:
    """Whether the backbone's packed kernels read no offsets on the host, so one captured graph
    per total-token bucket can replay new offsets (clef_worker.model.packed_layers: the fla path
    with `varlen_attn`, i.e. CUDA in bfloat16; not float32 or `--gdn-prefill torch`)."""
    if backbone.packed_kernels is None:
        backbone.packed_kernels = kernels_for(backbone.device, backbone.dtype, backbone.gdn_path)
    return backbone.packed_kernels.graph_safe


def packed_or_padded(backbone: Backbone, policy: BatchPolicy, *, explicit: bool) -> BatchPolicy:
    """With graphs to capture: the packed layout where its graphs can replay, else (for
    `--batch-layout auto`) the padded layout, whose graphs can; an explicit `packed` keeps
    packed rows, run eagerly (said at WARNING)."""
    if backbone_packs_in_graphs(backbone):
        return policy
    kernels = backbone.packed_kernels.names if backbone.packed_kernels else ()
    if explicit:
        log.warning("--batch-layout packed: the packed kernels %s read offsets on the host, so "
                    "packed forwards run eagerly, without CUDA graphs", kernels)
        return policy
    log.warning("the packed kernels %s read offsets on the host (packed rows cannot be "
                "captured): batches are padded, which graphs can replay", kernels)
    return dataclasses.replace(policy, layout=PADDED)


def build_graph_runner(backbone: Backbone, pad_id: int, capturer: Capturer, policy: BatchPolicy,
                       max_length: int, graph_max_length: int = 0,
                       selection: AdapterSelection | None = None
                       ) -> GraphRunner | PackedGraphRunner:
    """The graph runner for the policy's layout, its shapes planned from the policy: packed,
    one per total-token bucket up to the largest forward; padded, `[rows, bucket]` for the
    row counts up to the policy's requests per forward within its token budget. With variants
    (`selection`), either layout's shapes capture the stacked LoRA path over a static slot
    buffer."""
    if policy.layout == PADDED:
        table = BucketTable.for_budget(max_length, graph_max_length or None)
        return GraphRunner(backbone, table, pad_id, capturer,
                           plan_shapes(table, policy.max_batch_tokens,
                                       graph_row_counts(policy.max_sequences)), selection)
    buckets = packed_buckets(policy.max_batch_tokens, max_length, graph_max_length)
    return PackedGraphRunner(backbone, buckets, policy.max_sequences, pad_id, capturer,
                             selection)


def load_media(snapshot: Snapshot, encoder: Encoder, backbone: Backbone,
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


def assemble_snapshot(snapshot_dir: Path | str, **settings: Any) -> NativeExecutor:
    """Assemble an executor from a snapshot directory and `ModelSettings` fields (each says
    what it does): the one entry point of tests, benchmarks and tools."""
    return assemble(ModelSettings(snapshot_dir=Path(snapshot_dir), **settings))

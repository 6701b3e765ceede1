"""The Qwen3.5 text stack: building, loading, running (the kernel it runs is chosen first, by
`clef_worker.model.kernel_choice`).

Why the kernel choice happens here, first: transformers (5.x) binds the Gated DeltaNet prefill
kernel once, when `transformers.models.qwen3_5.modeling_qwen3_5` is first imported. Its
`@use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")` decorator runs
`importlib.import_module("fla")` and then resolves `fla.ops.gated_delta_rule
.chunk_gated_delta_rule`; any exception there binds the plain-torch chunked function instead. It
never looks at the device, so on a machine with fla and Triton but no GPU the fla kernel is bound
and the first forward fails. `choose_gdn_path` therefore runs before that import and, for the
torch path, puts `None` in `sys.modules` for `fla` and every `fla.*` (an import of them then raises
ImportError at once), and `bound_gdn_path` reads back what the decorator actually bound. On CPU the
same is done for `causal_conv1d` (a CUDA-only package transformers binds the same way). A CPU
worker then replaces transformers' torch function with `clef_worker.model.gated_delta`'s small-chunk
kernel (same arithmetic, a fraction of the per-token work; see that module).

Loading: the text stack is built on the meta device from `config.json`'s `text_config`, then
its tensors (`model.language_model.*`, never `model.visual.*`) are read from the safetensors files
straight onto the target device and cast to the target dtype, and assigned (`strict=True`). The
18.8 GB release is thus read once, without random initialisation and without the vision tower.
`lm_head.weight` is loaded alone as the lexical table; no vocabulary projection ever runs.

Warm-up buckets (fla only): of the kernels fla runs for `chunk_gated_delta_rule`, all autotune
on head counts and dimensions except the q/k L2-norm kernel, whose key includes
`NB = cdiv(rows, R)` with rows = tokens x heads; R is 65,536 from fla-core 0.5 on (2,048 before,
where the kernel is also recompiled for every distinct length, which no warm-up can cover).
So one forward per multiple of `R / heads` tokens up to `--max-length` meets every bucket; only
one Gated DeltaNet layer needs to run (all layers have the same shapes, hence the same keys).
Triton keeps the autotune results on disk (`cache_results`), so later starts are quick.

Attention backend (CUDA): cuDNN's scaled-dot-product attention builds an execution plan for every
new sequence length. Measured on an H200 with a 4096-wide model: the first request of a new
length took 150-240 ms instead of 20-45 ms, all of it in `_cudnn_attention_forward`. Requests have
arbitrary lengths, so nearly every request would pay that; `load_backbone` therefore disables the
cuDNN SDPA backend for the process and torch uses the flash or memory-efficient kernels, which
need no per-shape setup.
"""

from __future__ import annotations

import importlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from clef_worker.errors import StartupError
from clef_worker.model.snapshot import (
    LEXICAL_TABLE,
    TEXT_PREFIX,
    Snapshot,
    first_and_count,
    tensor_shapes,
)

if TYPE_CHECKING:
    from clef_worker.model.packed import PackedLayout
    from clef_worker.model.packed_layers import PackedKernels

log = logging.getLogger(__name__)

# The attention masks handed to the text stack: none. Given a mapping, transformers' Qwen3.5
# model uses it as its per-layer-type masks instead of building them. Built by transformers, the
# full-attention mask depends on whether it thinks it is tracing: eagerly, its packed-sequence
# check (`.all()`, a host sync) finds none and returns no mask, so SDPA runs causal (flash, GQA);
# inside a CUDA-graph capture `is_tracing` is true and it materialises a [T, T] mask, and SDPA
# then repeats K/V to every head and runs non-causal attention with a bias: another kernel,
# slower, with more memory. Our rows are right-padded and the stack is causal, so no mask is
# needed anywhere (clef_worker.serving.gpu.buckets), and none keeps capture and eager the same.
NO_MASKS: dict[str, None] = {"full_attention": None, "linear_attention": None}


# ---------------------------------------------------------------------------------------------
# Building and loading the text stack


@dataclass
class Backbone:
    """The loaded text stack and lexical table, on one device in one dtype."""

    model: Any  # transformers' Qwen3_5TextModel (its attributes are not typed for mypy)
    lexical_table: Tensor
    device: torch.device
    dtype: torch.dtype
    gdn_path: str
    # Chosen on the first packed forward (clef_worker.model.packed_layers.kernels_for).
    packed_kernels: PackedKernels | None = field(default=None, repr=False)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """Last hidden state (after the final norm) of one sequence: [T] ids -> [T, H]."""
        return self.last_hidden_state(input_ids.unsqueeze(0))[0]

    def last_hidden_state(self, input_ids: Tensor) -> Tensor:
        """Last hidden state of right-padded rows: [B, T] ids -> [B, T, H].

        Every forward of the text stack goes through here (eager, batched and graph capture),
        so all of them run the same attention: `NO_MASKS` (see there) makes transformers skip
        its mask construction, and SDPA gets no mask and runs causal.
        """
        output = self.model(input_ids=input_ids, attention_mask=dict(NO_MASKS), use_cache=False)
        return output.last_hidden_state

    def packed_hidden_state(self, input_ids: Tensor, layout: PackedLayout) -> Tensor:
        """Last hidden state of a packed row: [T] ids (the sequences' tokens back to back, any
        per-sequence right padding included, as `layout` places them) -> [T, H]. Each sequence's
        rows equal a separate `last_hidden_state` of it (clef_worker.model.packed_layers)."""
        from clef_worker.model.packed_layers import kernels_for, packed_forward

        if self.packed_kernels is None:
            self.packed_kernels = kernels_for(self.device, self.dtype, self.gdn_path)
            log.info("packed rows: delta rule %s, short convolution %s, attention %s, "
                     "norms/rotary/gates %s%s", *self.packed_kernels.names,
                     self.packed_kernels.fused.name,
                     "" if self.packed_kernels.graph_safe else " (offsets read on the host)")
        return packed_forward(self.model, input_ids, layout, self.packed_kernels)

    def gdn_layer(self) -> nn.Module | None:
        """The first Gated DeltaNet mixer, for kernel warm-up."""
        for layer in self.model.layers:
            mixer = getattr(layer, "linear_attn", None)
            if mixer is not None:
                return mixer
        return None

    def warm_gdn(self, lengths: list[int]) -> None:
        """Run one Gated DeltaNet layer at each length so fla autotunes every bucket now."""
        mixer = self.gdn_layer()
        if mixer is None:
            return
        generator = torch.Generator(device="cpu").manual_seed(0)
        for length in lengths:
            noise = torch.randn(1, length, self.hidden_size, generator=generator)
            mixer(noise.to(self.device, self.dtype))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def fla_rows_per_bucket() -> int:
    """The row count per autotune bucket of fla's q/k L2-norm kernel (see the module docs)."""
    try:
        version = importlib.import_module("fla").__version__
        major, minor = (int(part) for part in str(version).split(".")[:2])
    except Exception:
        return 2048 * 32
    if (major, minor) < (0, 5):
        log.warning(
            "fla %s recompiles its L2-norm kernel for every sequence length; warm-up cannot "
            "cover them all (fla-core >= 0.5 buckets lengths)", version,
        )
        return 2048
    return 2048 * 32


def gdn_warmup_lengths(max_length: int, heads: int, rows_per_bucket: int) -> list[int]:
    """The largest length of every L2-norm autotune bucket up to `max_length`.

    `heads` is the larger of the key and value head counts, so the lengths also cover the
    buckets of a transformers version that repeats q/k to the value heads.
    """
    step = max(1, rows_per_bucket // max(1, heads))
    lengths = list(range(step, max_length + 1, step))
    if not lengths or lengths[-1] != max_length:
        lengths.append(max_length)
    return lengths


def configure_attention(device: torch.device) -> None:
    """On CUDA, turn off cuDNN's SDPA backend (a plan build per new length; see module docs)."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def build_on_meta(snapshot: Snapshot, model_class: Any, config_part: str, what: str) -> Any:
    """One part of the release's model (`config_part` of its Qwen3.5 config) built on the meta
    device: shapes without memory, so tensors are checked before any is read. A config the
    class cannot build from is a start-up error naming `config.json`."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    try:
        part = getattr(Qwen3_5Config.from_dict(snapshot.config), config_part)
        with torch.device("meta"):
            return model_class(part)
    except Exception as exc:
        raise StartupError(f"{snapshot.root / 'config.json'}: cannot build {what}: "
                           f"{exc}") from exc


def load_backbone(
    snapshot: Snapshot, device: torch.device, dtype: torch.dtype, gdn_path: str
) -> Backbone:
    """Build the text stack on meta, check and load its tensors, load the lexical table."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    model = build_on_meta(snapshot, Qwen3_5TextModel, "text_config", "the text stack")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    files = snapshot.text_tensors()
    _check_backbone_tensors(snapshot, expected, files)
    lexical_shape = (int(snapshot.text_config["vocab_size"]), snapshot.hidden_size)
    lexical_file = snapshot.weights[LEXICAL_TABLE]
    found = tensor_shapes(lexical_file, [LEXICAL_TABLE]).get(LEXICAL_TABLE)
    if found != lexical_shape:
        raise StartupError(
            f"{lexical_file}: tensor {LEXICAL_TABLE} has shape {list(found or ())}, expected "
            f"{list(lexical_shape)} (text_config vocab_size x hidden_size)"
        )

    configure_attention(device)
    state = read_tensors(
        {name: files[name] for name in expected}, device, dtype, prefix=TEXT_PREFIX
    )
    model.load_state_dict(state, strict=True, assign=True)
    del state
    lexical = read_tensors({LEXICAL_TABLE: lexical_file}, device, dtype)[LEXICAL_TABLE]
    _materialise_buffers(model, device)
    model.eval()
    model.requires_grad_(False)
    return Backbone(model=model, lexical_table=lexical, device=device, dtype=dtype,
                    gdn_path=gdn_path)


def _check_backbone_tensors(
    snapshot: Snapshot, expected: dict[str, tuple[int, ...]], files: dict[str, Path]
) -> None:
    missing = [name for name in expected if name not in files]
    if missing:
        raise StartupError(
            f"snapshot {snapshot.root}: the backbone weights lack tensor "
            f"{first_and_count(missing, TEXT_PREFIX)} required by config.json"
        )
    extra = sorted(set(files) - set(expected))
    if extra:
        log.warning("ignoring %d text tensors the model does not use (e.g. %s%s)", len(extra),
                    TEXT_PREFIX, extra[0])
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in expected:
        by_file[files[name]].append(name)
    for path, names in by_file.items():
        shapes = tensor_shapes(path, [TEXT_PREFIX + name for name in names])
        for name in names:
            shape = shapes.get(TEXT_PREFIX + name)
            if shape is None:
                raise StartupError(f"{path}: missing tensor {TEXT_PREFIX}{name} (listed in the "
                                   "shard index)")
            if shape != expected[name]:
                raise StartupError(
                    f"{path}: tensor {TEXT_PREFIX}{name} has shape {list(shape)}, expected "
                    f"{list(expected[name])} from config.json"
                )


def read_tensors(
    files: dict[str, Path], device: torch.device, dtype: torch.dtype, prefix: str = ""
) -> dict[str, Tensor]:
    """Read named tensors (file key = prefix + name) straight onto the device, cast to dtype."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in files.items():
        by_file[path].append(name)
    target = str(device) if device.type == "cuda" else "cpu"
    tensors: dict[str, Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device=target) as handle:
                for name in names:
                    tensors[name] = handle.get_tensor(prefix + name).to(dtype)
        except StartupError:
            raise
        except Exception as exc:
            raise StartupError(f"{path}: cannot read tensors: {exc}") from exc
    return tensors


def _materialise_buffers(model: nn.Module, device: torch.device) -> None:
    """Recreate the non-persistent buffers (rotary frequencies) that meta construction left empty.

    They are computed from the config in float32, as `from_pretrained` would, whatever the
    weights' dtype.
    """
    rotary = getattr(model, "rotary_emb", None)
    if rotary is not None:
        model.rotary_emb = type(rotary)(model.config).to(device)
    leftover = [name for name, b in model.named_buffers() if b.is_meta]
    leftover += [name for name, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise StartupError(f"internal: tensors left unloaded after loading: {leftover[:3]}")


def describe_kernel_lengths(backbone: Backbone, max_length: int) -> list[int]:
    """The warm-up lengths for this backbone's fla path (empty on the torch path)."""
    if backbone.gdn_path != "fla":
        return []
    config: Any = backbone.model.config
    heads = max(int(config.linear_num_key_heads), int(config.linear_num_value_heads))
    return gdn_warmup_lengths(max_length, heads, fla_rows_per_bucket())


"""Fine-tuned variants (clef-finetune checkpoints) loaded over the one base backbone.

A checkpoint is `adapter/adapter_config.json` + `adapter/adapter_model.safetensors` (PEFT LoRA:
`base_model.model.model.language_model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]), `joint_head.safetensors` (the release head's tensor names) and `train_config.json`.
Its `training_state.pt` (a pickle of the optimizer) is never opened: nothing here unpickles
anything, only JSON and safetensors are read.

Each checkpoint is checked against the loaded base before any of its tensors is read: the LoRA
configuration field by field (clef_worker.adapter_config: served only where PEFT's forward for
it is the one applied here), every adapted module present in the text stack, linear and named
by `target_modules` as PEFT matches it, A and B shaped for it and for the rank, floating point,
both present; the head's tensors exactly the base head's names and shapes. A bad checkpoint
is refused with an ERROR naming the file and the field or tensor (`load_variants`' caller
decides: the worker serves the rest, so a checkpoint gone bad before a roll or a crash never
stops the server); the others are served in their order. A checkpoint whose
`base_model_name_or_path` does not name the served base is served with a WARNING (it may be the
same weights under another name; the shapes are checked, provenance cannot be).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from clef_protocol.finetune import Finetune
from clef_worker.adapter_config import LoraConfig, names_the_base, read_lora_config
from clef_worker.errors import StartupError
from clef_worker.model.backbone import Backbone
from clef_worker.model.head import JointSchemaHead
from clef_worker.model.lora import AdaptedLinear, AdapterSelection, LoraWeights, adapt

log = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HEAD_WEIGHTS = "joint_head.safetensors"
# PEFT's key for a module of the text stack of Qwen3_5ForConditionalGeneration, and the
# module's name in the base model (what `target_modules` is matched against).
KEY_PREFIX = "base_model.model.model.language_model."
MODULE_PREFIX = "model.language_model."
KEY_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Variant:
    """One loaded variant: its name, slot (1-based; 0 is the base), LoRA rank and scale, head,
    and where it came from."""

    name: str
    slot: int
    rank: int
    scale: float
    head: JointSchemaHead
    checkpoint: Path
    modules: int
    parameters: int  # LoRA and head parameters together
    memory_bytes: int  # what they hold on the device (LoRA in the backbone's dtype, head in its)
    base_model: str | None = None  # the adapter config's base_model_name_or_path

    def describe(self) -> dict[str, Any]:
        """What `ready` and /health say about it."""
        return {"name": self.name, "rank": self.rank, "scale": self.scale,
                "head": str(self.checkpoint / HEAD_WEIGHTS), "checkpoint": str(self.checkpoint),
                "adapted_modules": self.modules, "parameters": self.parameters,
                "memory_bytes": self.memory_bytes,
                "base_model_name_or_path": self.base_model}


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The text stack's linear layers by module name (as PEFT names them after the prefix); a
    layer already adapted for another variant is named as it was, by its base layer."""
    layers: dict[str, nn.Linear] = {}
    wrapped: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            layers[name] = module.base
            wrapped.add(f"{name}.base")
        elif isinstance(module, nn.Linear) and name not in wrapped:
            layers[name] = module
    return layers


def open_checkpoint_file(path: Path) -> Any:
    """A checkpoint's safetensors file opened lazily (tensors read one by one, after their
    names and shapes were checked), or a StartupError naming the file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise StartupError(f"{path}: missing (not a clef-finetune checkpoint)") from None
    except Exception as exc:
        raise StartupError(f"{path}: cannot read it as safetensors: {exc}") from None


def checked_tensor(handle: Any, path: Path, key: str) -> Tensor:
    """One tensor of a checkpoint file, refused unless it is floating point and finite (a NaN
    in an adapter or a head would serve NaN probabilities behind a 200)."""
    tensor: Tensor = handle.get_tensor(key)
    if tensor.dtype not in FLOATS:
        raise StartupError(f"{path}: tensor {key} is {tensor.dtype}, expected a floating point "
                           "type")
    if not torch.isfinite(tensor).all():
        raise StartupError(f"{path}: tensor {key} holds NaN or infinity")
    return tensor


def read_adapter(path: Path, config: LoraConfig, layers: dict[str, nn.Linear]
                 ) -> dict[str, tuple[Tensor, Tensor]]:
    """Check then read every module's (A, B) from `adapter_model.safetensors`, as float32."""
    handle = open_checkpoint_file(path)
    with handle:
        keys = list(handle.keys())
        parts: dict[str, dict[str, Any]] = {}
        for key in keys:
            suffix = next((s for s in KEY_SUFFIXES if key.endswith(s)), None)
            if not key.startswith(KEY_PREFIX) or suffix is None:
                raise StartupError(f"{path}: tensor {key} is not a LoRA A or B of the text stack "
                                   f"({KEY_PREFIX}<module>.lora_A/B.weight): only the text "
                                   "stack's linear layers can be served unmerged")
            module = key[len(KEY_PREFIX):-len(suffix)]
            layer = layers.get(module)
            if layer is None:
                raise StartupError(f"{path}: tensor {key} adapts {module}, which is not a linear "
                                   "layer of the base's text stack")
            if not config.targets(MODULE_PREFIX + module):
                raise StartupError(f"{path}: tensor {key} adapts {MODULE_PREFIX}{module}, which "
                                   "target_modules does not name: PEFT would not load it")
            piece = handle.get_slice(key)
            shape = tuple(piece.get_shape())
            expected = ((config.rank, layer.in_features) if "lora_A" in suffix
                        else (layer.out_features, config.rank))
            if shape != expected:
                raise StartupError(f"{path}: tensor {key} has shape {list(shape)}, expected "
                                   f"{list(expected)} (rank {config.rank}, layer "
                                   f"{layer.out_features}x{layer.in_features})")
            parts.setdefault(module, {})[suffix] = key
        for module, found in parts.items():
            for suffix in KEY_SUFFIXES:
                if suffix not in found:
                    raise StartupError(f"{path}: tensor {KEY_PREFIX}{module}{suffix} is missing "
                                       "(each adapted module needs lora_A and lora_B)")
        if not parts:
            raise StartupError(f"{path}: holds no LoRA tensors")
        if config.random_init:
            for module in sorted(set(layers) - set(parts)):
                if config.targets(MODULE_PREFIX + module):
                    raise StartupError(
                        f"{path}: {MODULE_PREFIX}{module} is named by target_modules but has no "
                        "tensors: with this init_lora_weights PEFT would give it random factors")
        out: dict[str, tuple[Tensor, Tensor]] = {}
        for module, found in sorted(parts.items()):
            pair = []
            for suffix in KEY_SUFFIXES:
                pair.append(checked_tensor(handle, path, found[suffix]).float())
            out[module] = (pair[0], pair[1])
    return out


def read_head(path: Path, base: JointSchemaHead, device: torch.device, dtype: torch.dtype
              ) -> JointSchemaHead:
    """The variant's head: the base head's structure with the checkpoint's tensors (exactly the
    same names and shapes)."""
    expected = {name: tuple(t.shape) for name, t in base.state_dict().items()}
    handle = open_checkpoint_file(path)
    state: dict[str, Tensor] = {}
    with handle:
        keys = set(handle.keys())
        for name in sorted(set(expected) - keys):
            raise StartupError(f"{path}: tensor {name} is missing (the base head has it)")
        for name in sorted(keys - set(expected)):
            raise StartupError(f"{path}: tensor {name} is not a tensor of the base head")
        for name, shape in expected.items():
            found = tuple(handle.get_slice(name).get_shape())
            if found != shape:
                raise StartupError(f"{path}: tensor {name} has shape {list(found)}, expected "
                                   f"{list(shape)} (the base head's)")
            state[name] = checked_tensor(handle, path, name).to(device, dtype)
    with torch.device("meta"):
        head = JointSchemaHead(base.config)
    head.load_state_dict(state, strict=True, assign=True)
    head.eval()
    head.requires_grad_(False)
    return head


def load_variants(finetunes: list[Finetune], backbone: Backbone, base_head: JointSchemaHead,
                  selection: AdapterSelection, served: Sequence[str] = (),
                  snapshot: Path | None = None,
                  on_refused: Callable[[Finetune, StartupError], None] | None = None
                  ) -> list[Variant]:
    """Check every checkpoint (all of them, before any is attached), then adapt the backbone's
    layers and attach each variant's updates in its slot. The LoRA weights are kept in the
    backbone's dtype on its device; the head in the base head's dtype. `served` (the served
    model's names) and `snapshot` (its directory) are what a checkpoint's
    `base_model_name_or_path` should name; a mismatch is logged at WARNING. A checkpoint that
    fails a check raises its StartupError, or, given `on_refused`, is handed to it and left
    out (the slots are the served variants' order)."""
    if not finetunes:
        return []
    layers = linear_layers(backbone.model)
    head_dtype = base_head.hidden_norm.weight.dtype
    checked = []
    for finetune in finetunes:
        try:
            adapter_dir = finetune.checkpoint / ADAPTER_DIR
            config = read_lora_config(adapter_dir / ADAPTER_CONFIG)
            tensors = read_adapter(adapter_dir / ADAPTER_WEIGHTS, config, layers)
            head = read_head(finetune.checkpoint / HEAD_WEIGHTS, base_head, backbone.device,
                             head_dtype)
        except StartupError as exc:
            if on_refused is None:
                raise
            on_refused(finetune, exc)
            continue
        except OSError as exc:  # unreadable: permissions, a file removed while read
            if on_refused is None:
                raise StartupError(f"{finetune.checkpoint}: cannot read it: {exc}") from None
            on_refused(finetune, StartupError(f"{finetune.checkpoint}: cannot read it: {exc}"))
            continue
        checked.append((finetune, config, tensors, head))
        if snapshot is not None:
            warn_foreign_base(finetune, config, served, snapshot)
    variants = []
    for slot, (finetune, config, tensors, head) in enumerate(checked, start=1):
        adapted = adapt(backbone.model, list(tensors), selection)
        for module, (a, b) in tensors.items():
            adapted[module].add(slot, LoraWeights(
                a=a.to(backbone.device, backbone.dtype),
                scaled_b=(b * config.scale).to(backbone.device, backbone.dtype)))
        lora = sum(a.numel() + b.numel() for a, b in tensors.values())
        head_tensors = list(head.state_dict().values())
        head_count = sum(t.numel() for t in head_tensors)
        memory = (lora * backbone.lexical_table.element_size()
                  + sum(t.numel() * t.element_size() for t in head_tensors))
        variants.append(Variant(name=finetune.name, slot=slot, rank=config.rank,
                                scale=config.scale, head=head, checkpoint=finetune.checkpoint,
                                modules=len(tensors), parameters=lora + head_count,
                                memory_bytes=memory, base_model=config.base_model))
        log.info("variant %s: LoRA rank %d scale %g on %d modules, head from %s", finetune.name,
                 config.rank, config.scale, len(tensors), finetune.checkpoint / HEAD_WEIGHTS)
    return variants


def warn_foreign_base(finetune: Finetune, config: LoraConfig, served: Sequence[str],
                      snapshot: Path) -> None:
    """A WARNING when the checkpoint says it was trained over another base than the one
    served (or does not say): its shapes fit, but its answers mean something only over the base
    it was trained on."""
    if config.base_model is not None and names_the_base(config.base_model, served, snapshot):
        return
    log.warning("variant %s: its adapter was trained over base_model_name_or_path %r, and this "
                "worker serves %s (snapshot %s): its answers mean something only over the base "
                "it was trained on", finetune.name, config.base_model,
                " / ".join(served) or "the base", snapshot)


def refuse_variant(finetune: Finetune, exc: StartupError) -> None:
    """`load_variants`' `on_refused` in the worker: the checkpoint is not served, and the log
    says which and why (the rest is served)."""
    log.error("variant %s refused, not served: %s", finetune.name, exc)

"""A fine-tuned variant's `adapter/adapter_config.json` (PEFT's `LoraConfig`): what this server
serves, and which modules the adapter adapts.

Why a table of every field: this server applies `y = x Wᵀ + scale · (x Aᵀ) Bᵀ` to the modules
the checkpoint holds A and B for. PEFT's own forward for the same checkpoint depends on more
than `r` and `lora_alpha`: a field set to a non-default value can add a bias, rescale, restrict
the adapter to some tokens, rewrite the base weights at load, or replace the layer with a LoRA
variant. A checkpoint is served only when every field is at a value whose PEFT forward is the
one served here; any other value is refused at start-up naming the field. `FIELDS` decides each
field of PEFT 0.21's `LoraConfig` and `PeftConfig` (read from PEFT's source: `LoraConfig`,
`LoraLayer.update_layer`, `check_target_module_exists`); a field not in it (a newer PEFT's) is
refused unless it is unset (null, false or empty), since what it does is unknown here.
docs/finetune.md lists the same decisions for operators (a test keeps the two the same).

Which modules: PEFT adapts the modules whose names `target_modules` matches
(`check_target_module_exists`): a string is a regular expression the whole module name must
match (`re.fullmatch`; `all-linear` means every linear layer but the output layer); a list
matches a name equal to an entry or ending in `.entry`. The names are the base model's module
names (`model.language_model.layers.0.mlp.up_proj`), `LoraConfig.targets` matches them the same
way. A tensor for a module `target_modules` does not match is refused: PEFT would skip it on
load (a state-dict key no layer has, a warning), so the checkpoint does not say what it holds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clef_worker.errors import StartupError

# `init_lora_weights` values whose initialisation rewrites the base layer's weight when PEFT
# creates the adapter, also when it loads a trained checkpoint (PiSSA, OLoRA and CorDA subtract
# the initial factors from W, LoftQ quantises W); LoRA-GA rewrote it during training and its
# saved factors are relative to that residual (PEFT converts such checkpoints, writing `true`,
# only when saved with `path_initial_model_for_weight_conversion`). Over the unmodified base
# these checkpoints do not compute the trained model.
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
# Values whose initialisation leaves the base weight alone; the loaded A and B replace the
# initial factors, so the forward is the checkpoint's whatever the value.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
# Of those, the ones that draw non-zero factors for a targeted module the checkpoint holds no
# tensors for (PEFT keeps the initial factors of a missing key): `false` (nn.Linear's own init
# for A and B) and `orthogonal`. The others start B or A at zero, a no-op, as this server
# treats a module without tensors.
RANDOM_INITS = (False, "orthogonal")
ALL_LINEAR = "all-linear"


def unset(value: Any) -> bool:
    """Whether a field is at its off value: null, false, or an empty string, list or dict."""
    return value is None or value is False or value in ("", [], {})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _init(value: Any) -> bool:
    return any(value is plain if isinstance(plain, bool) else value == plain
               for plain in PLAIN_INITS)


def _random_init(value: Any) -> bool:
    return any(value is init if isinstance(init, bool) else value == init
               for init in RANDOM_INITS)


def _targets(value: Any) -> bool:
    if isinstance(value, str):
        return value.lower() == ALL_LINEAR or _compiles(value)
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _any(value: Any) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """One field's decision: which values are served (`accepts`), and what the field does
    (said in the refusal, and in docs/finetune.md's table)."""

    accepts: Callable[[Any], bool]
    does: str
    served: str  # the values served, as the refusal and the docs say them


OFF = "unset (null, false or empty)"
FIELDS: dict[str, Rule] = {
    # PeftConfig: what the checkpoint is and where it came from.
    "peft_type": Rule(lambda v: v == "LORA", "the adapter method", "'LORA'"),
    "base_model_name_or_path": Rule(_any, "the base it was trained on (shown in /health; a "
                                    "mismatch with the served model is logged)", "any"),
    "revision": Rule(_any, "the base's revision (provenance)", "any"),
    "task_type": Rule(_any, "PEFT's model wrapper; the tensor names are checked instead",
                      "any"),
    "inference_mode": Rule(_any, "whether PEFT loads it trainable", "any"),
    "auto_mapping": Rule(_any, "the base model's class (provenance)", "any"),
    "peft_version": Rule(_any, "the PEFT version that saved it (provenance)", "any"),
    # LoraConfig: the served forward.
    "r": Rule(_positive_int, "the rank", "a positive integer"),
    "lora_alpha": Rule(lambda v: _number(v) and v > 0, "the scale's numerator",
                       "a positive number"),
    "use_rslora": Rule(lambda v: isinstance(v, bool),
                       "the scale: lora_alpha / sqrt(r) when true, lora_alpha / r when false",
                       "true or false"),
    "target_modules": Rule(_targets, "which modules are adapted (matched as PEFT matches them)",
                           "a regular expression, 'all-linear' or a list of names"),
    "lora_dropout": Rule(lambda v: _number(v) and 0 <= v <= 1,
                         "dropout on the adapter's input while training, none at inference",
                         "a number from 0 to 1"),
    "fan_in_fan_out": Rule(_any, "transposed base weights (GPT-2's Conv1D); PEFT resets it to "
                           "false for the nn.Linear layers adapted here", "any"),
    "init_lora_weights": Rule(_init, "the factors' initialisation; pissa, olora, corda and "
                              "loftq rewrite the base weights when PEFT loads the checkpoint, "
                              "lora_ga's factors are relative to a rewritten base",
                              ", ".join(json.dumps(v) for v in PLAIN_INITS)),
    "bias": Rule(lambda v: v == "none", "trained biases of the base layers ('all', "
                 "'lora_only'), loaded with the adapter", "'none'"),
    "lora_bias": Rule(unset, "a bias on lora_B", OFF),
    "modules_to_save": Rule(unset, "whole modules trained and saved beside the adapter", OFF),
    "layers_to_transform": Rule(unset, "restricts target_modules to some layer indices", OFF),
    "layers_pattern": Rule(unset, "the layer list layers_to_transform indexes", OFF),
    "rank_pattern": Rule(unset, "per-module ranks", OFF),
    "alpha_pattern": Rule(unset, "per-module alphas", OFF),
    "exclude_modules": Rule(unset, "modules kept out of target_modules", OFF),
    "target_parameters": Rule(unset, "LoRA on parameters (e.g. a mixture of experts' weights), "
                              "not on linear layers", OFF),
    "trainable_token_indices": Rule(unset, "trained rows of the token embedding", OFF),
    "layer_replication": Rule(unset, "a layer stack built by repeating base layers", OFF),
    "use_dora": Rule(unset, "DoRA: a trained magnitude vector rescales each adapted layer", OFF),
    "alora_invocation_tokens": Rule(unset, "Activated LoRA: the adapter applies only from the "
                                    "invocation tokens on", OFF),
    "use_qalora": Rule(unset, "QALoRA: lora_A reads the input pooled in groups", OFF),
    "qalora_group_size": Rule(_any, "QALoRA's group size, read only with use_qalora", "any"),
    "megatron_config": Rule(unset, "Megatron's parallel linear layers", OFF),
    "megatron_core": Rule(_any, "the Megatron module, read only with megatron_config", "any"),
    "use_bdlora": Rule(unset, "BD-LoRA: block-diagonal factors", OFF),
    "arrow_config": Rule(unset, "Arrow: routing among several adapters per token", OFF),
    "kasa_config": Rule(unset, "KaSA: truncates the base's singular values and adds a trained "
                        "diagonal between A and B", OFF),
    "monteclora_config": Rule(unset, "MonteCLoRA: a LoRA variant with its own layer (Monte Carlo "
                              "sampling of the factors)", OFF),
    "velora_config": Rule(unset, "VeLoRA: a LoRA variant whose layers carry buffers this server "
                          "does not read", OFF),
    "eva_config": Rule(_any, "EVA's initialisation data, read only at init", "any"),
    "corda_config": Rule(_any, "CorDA's initialisation data, read only with init_lora_weights "
                         "'corda' (refused)", "any"),
    "loftq_config": Rule(_any, "LoftQ's settings, read only with init_lora_weights 'loftq' "
                         "(refused)", "any"),
    "lora_ga_config": Rule(_any, "LoRA-GA's settings, read only with init_lora_weights "
                           "'lora_ga' (refused)", "any"),
    "ensure_weight_tying": Rule(_any, "ties adapters of tied modules (embeddings, lm_head), "
                                "which are never adapted here", "any"),
    "runtime_config": Rule(_any, "runtime settings PEFT does not save", "any"),
}
REQUIRED = ("peft_type", "r", "lora_alpha", "target_modules")


@dataclass(frozen=True)
class LoraConfig:
    """The served part of a checked `adapter_config.json`."""

    rank: int
    alpha: float
    rslora: bool
    target_modules: str | tuple[str, ...]
    random_init: bool  # PEFT draws non-zero factors for a targeted module without tensors
    base_model: str | None  # base_model_name_or_path, as written

    @property
    def scale(self) -> float:
        """PEFT's `scaling`: alpha / sqrt(r) with rsLoRA, else alpha / r."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets(self, name: str) -> bool:
        """Whether PEFT adapts the module of this name (the base model's module name)."""
        targets = self.target_modules
        if isinstance(targets, str):
            return targets.lower() == ALL_LINEAR or re.fullmatch(targets, name) is not None
        return name in targets or any(name.endswith(f".{target}") for target in targets)


def read_lora_config(path: Path) -> LoraConfig:
    """Check `adapter_config.json` field by field (`FIELDS`); StartupError names the file and
    the first field whose value this server would not serve as PEFT runs it."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StartupError(f"{path}: missing (not a clef-finetune checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise StartupError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise StartupError(f"{path}: not a JSON object")
    for name in REQUIRED:
        if name not in raw:
            raise StartupError(f"{path}: {name} is missing")
    for name, value in raw.items():
        refusal = field_refusal(name, value)
        if refusal:
            raise StartupError(f"{path}: {refusal}")
    return LoraConfig(
        rank=raw["r"], alpha=float(raw["lora_alpha"]), rslora=bool(raw.get("use_rslora")),
        target_modules=(raw["target_modules"] if isinstance(raw["target_modules"], str)
                        else tuple(raw["target_modules"])),
        random_init=_random_init(raw.get("init_lora_weights", True)),
        base_model=(raw.get("base_model_name_or_path")
                    if isinstance(raw.get("base_model_name_or_path"), str) else None))


def field_refusal(name: str, value: Any) -> str:
    """Why this server refuses the field at this value ('' when it serves it)."""
    rule = FIELDS.get(name)
    if rule is None:
        if unset(value):
            return ""
        return (f"{name} is {json.dumps(value)}: a field this server does not know (a newer "
                "PEFT's?), so it cannot tell whether it changes the adapter's forward; served "
                "only unset")
    if rule.accepts(value):
        return ""
    return (f"{name} is {json.dumps(value)}: {rule.does}; this server serves only "
            f"{rule.served}")


def names_the_base(base_model: str, served: Sequence[str], snapshot: Path) -> bool:
    """Whether `base_model_name_or_path` names the base being served: the snapshot's directory
    (as a path, or its last component, as a hub id's name would be) or a served model name."""
    written = base_model.rstrip("/")
    last = written.rsplit("/", 1)[-1]
    names = {name.lower() for name in (*served, snapshot.name)}
    if last.lower() in names:
        return True
    try:
        return Path(written).expanduser().resolve() == snapshot.resolve()
    except OSError:
        return False

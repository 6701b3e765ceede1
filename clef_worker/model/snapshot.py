"""Locating and checking a release snapshot before anything is loaded (spec §1).

Every file the native executor needs is looked for up front, and the head's tensors are checked
against its config by reading safetensors headers only, so a wrong or incomplete snapshot fails
start-up in well under a second with a message that names the file (and the tensor), instead of
minutes into loading 18 GB or at the first request.

Variant check: the backbone's hidden size must always equal the head's `hidden_size`. A release
snapshot must also have the hidden size of the `--variant` asked for (clef-flash 4096,
clef 5120). Snapshots that carry the `TINY_RANDOM_MODEL.txt` marker (the shared test fixture,
the generated demo snapshot) or are opened with `demo=True` skip that known-size check: they are
tiny on purpose, and the executor reports them as demo (answers are meaningless).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from clef_worker.errors import StartupError
from clef_worker.model.head import HeadConfig, JointSchemaHead

log = logging.getLogger(__name__)

CONFIG = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
HEAD_CONFIG = "joint_head_config.json"
HEAD_WEIGHTS = "joint_head.safetensors"
RANDOM_MARKER = "TINY_RANDOM_MODEL.txt"
LEXICAL_TABLE = "lm_head.weight"
TEXT_PREFIX = "model.language_model."

KNOWN_HIDDEN_SIZES: dict[str, int] = {"clef-flash": 4096, "clef": 5120}


@dataclass(frozen=True)
class Snapshot:
    """A checked snapshot directory: where each tensor lives and the configs it carries."""

    root: Path
    config: dict[str, Any]
    weights: dict[str, Path]  # backbone tensor name -> the safetensors file holding it
    tokenizer_file: Path
    head_config: HeadConfig
    head_file: Path
    variant: str
    random: bool

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["text_config"]

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    def text_tensors(self) -> dict[str, Path]:
        """The text stack's tensors (prefix stripped), without the vision tower's."""
        return {
            name[len(TEXT_PREFIX):]: path
            for name, path in self.weights.items()
            if name.startswith(TEXT_PREFIX)
        }


def open_snapshot(root: Path | str, *, variant: str, demo: bool = False) -> Snapshot:
    """Check a snapshot directory and describe it; StartupError names what is missing or wrong."""
    root = Path(root)
    if not root.is_dir():
        raise StartupError(f"snapshot directory {root} does not exist or is not a directory")
    if variant not in KNOWN_HIDDEN_SIZES:
        known = ", ".join(KNOWN_HIDDEN_SIZES)
        raise StartupError(f"unknown --variant {variant!r}: expected one of {known}")
    config = _read_config(root)
    weights = _weight_map(root)
    if LEXICAL_TABLE not in weights:
        raise StartupError(
            f"{root}: the backbone weights have no tensor {LEXICAL_TABLE} (the lexical table "
            "the head reads option token rows from)"
        )
    if not any(name.startswith(TEXT_PREFIX) for name in weights):
        raise StartupError(f"{root}: the backbone weights have no {TEXT_PREFIX}* tensors")
    tokenizer_file = _required(root, TOKENIZER, "the Qwen3.5 tokenizer")
    head_config = _read_head_config(root)
    head_file = _required(root, HEAD_WEIGHTS, "the joint schema head's weights")
    hidden = int(config["text_config"]["hidden_size"])
    if head_config.hidden_size != hidden:
        raise StartupError(
            f"{root / HEAD_CONFIG}: hidden_size {head_config.hidden_size} does not match the "
            f"backbone's hidden size {hidden} ({CONFIG} text_config.hidden_size)"
        )
    check_head_tensors(head_file, head_config)
    random = demo or (root / RANDOM_MARKER).exists()
    expected = KNOWN_HIDDEN_SIZES[variant]
    if random:
        log.warning(
            "%s is a tiny random test/demo snapshot (hidden size %d): the --variant %s size "
            "check is skipped and its answers are meaningless",
            root, hidden, variant,
        )
    elif hidden != expected:
        others = [name for name, size in KNOWN_HIDDEN_SIZES.items() if size == hidden]
        hint = f" (that is the {others[0]} release)" if others else ""
        raise StartupError(
            f"--variant {variant} expects hidden size {expected}, but the snapshot {root} has "
            f"hidden size {hidden}{hint}; pass the matching --variant or the right snapshot"
        )
    return Snapshot(
        root=root,
        config=config,
        weights=weights,
        tokenizer_file=tokenizer_file,
        head_config=head_config,
        head_file=head_file,
        variant=variant,
        random=random,
    )


def _required(root: Path, name: str, what: str) -> Path:
    path = root / name
    if not path.is_file():
        raise StartupError(f"snapshot {root} is missing {name} ({what})")
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StartupError(f"{path}: cannot read it as JSON: {exc}") from exc


def _read_config(root: Path) -> dict[str, Any]:
    path = _required(root, CONFIG, "the Qwen3.5 model config")
    config = _read_json(path)
    if not isinstance(config, dict) or config.get("model_type") != "qwen3_5":
        found = config.get("model_type") if isinstance(config, dict) else None
        raise StartupError(
            f"{path}: model_type must be 'qwen3_5' (a Qwen3_5ForConditionalGeneration "
            f"config), found {found!r}"
        )
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise StartupError(f"{path}: no text_config object")
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise StartupError(f"{path}: text_config.{key} must be a positive integer")
    return config


def _weight_map(root: Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index or the single weights file."""
    index_path = root / WEIGHTS_INDEX
    if index_path.is_file():
        index = _read_json(index_path)
        mapping = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(mapping, dict) or not mapping:
            raise StartupError(f"{index_path}: no weight_map object")
        weights: dict[str, Path] = {}
        for name, file_name in mapping.items():
            if not isinstance(file_name, str) or "/" in file_name or "\\" in file_name:
                raise StartupError(f"{index_path}: bad shard name {file_name!r} for {name}")
            weights[name] = root / file_name
        for shard in sorted(set(weights.values())):
            if not shard.is_file():
                raise StartupError(
                    f"snapshot {root} is missing {shard.name} (a backbone shard listed in "
                    f"{WEIGHTS_INDEX})"
                )
        return weights
    single = root / SINGLE_WEIGHTS
    if not single.is_file():
        raise StartupError(
            f"snapshot {root} has no backbone weights: expected {SINGLE_WEIGHTS} or "
            f"{WEIGHTS_INDEX} with its shards"
        )
    return dict.fromkeys(tensor_shapes(single), single)


def tensor_shapes(path: Path, names: Iterable[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Shapes of a safetensors file's tensors, from its header alone (nothing is loaded)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            keys = list(handle.keys()) if names is None else list(names)
            available = set(handle.keys())
            return {
                name: tuple(handle.get_slice(name).get_shape())
                for name in keys
                if name in available
            }
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise StartupError(f"{path}: not a readable safetensors file: {exc}") from exc


def _read_head_config(root: Path) -> HeadConfig:
    path = _required(root, HEAD_CONFIG, "the joint schema head's config")
    try:
        return HeadConfig.from_file(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError) as exc:
        raise StartupError(f"{path}: {exc}") from exc


def expected_head_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the head this config describes (built on the meta device)."""
    with torch.device("meta"):
        head = JointSchemaHead(config)
    return {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}


def first_and_count(names: list[str], prefix: str = "") -> str:
    """The first of `names` (after `prefix`), and how many more there are: one message shape
    for every missing or unexpected tensor list."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return f"{prefix}{names[0]}{more}"


def check_head_tensors(path: Path, config: HeadConfig) -> None:
    """The head file must hold exactly the config's tensors with exactly their shapes."""
    expected = expected_head_shapes(config)
    found = tensor_shapes(path)
    missing = [name for name in expected if name not in found]
    if missing:
        raise StartupError(
            f"{path}: missing tensor {first_and_count(missing)} required by {HEAD_CONFIG}"
        )
    unexpected = [name for name in found if name not in expected]
    if unexpected:
        raise StartupError(
            f"{path}: unexpected tensor {first_and_count(unexpected)} not described by "
            f"{HEAD_CONFIG}"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise StartupError(
                f"{path}: tensor {name} has shape {list(found[name])}, expected {list(shape)} "
                f"from {HEAD_CONFIG}"
            )

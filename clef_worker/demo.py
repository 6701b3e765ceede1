"""The built-in demo snapshot: a tiny random Clef model in the exact release layout.

`clef-serve --model demo` must start on a fresh machine with no download, and it must exercise
the same loading, encoding and scoring code as a real snapshot, so that a demo that works proves
the serving path works. That rules out a fake executor: instead this module *generates* a real
snapshot directory (config.json, model.safetensors, tokenizer.json, joint_head_config.json,
joint_head.safetensors, ...) whose weights are random. Its answers are meaningless; its arithmetic
is real.

Generation is deterministic (fixed seeds, one RNG stream per tensor keyed by the tensor's name,
tokenizer trained on a built-in corpus), so the same library versions always produce the same
bytes, and it happens once: the snapshot is cached under

    $CLEF_SERVE_CACHE/demo-v<FORMAT>-<fingerprint>/          (if CLEF_SERVE_CACHE is set)
    $XDG_CACHE_HOME/clef-serve/demo-v<FORMAT>-<fingerprint>/  (else, if XDG_CACHE_HOME is set)
    ~/.cache/clef-serve/demo-v<FORMAT>-<fingerprint>/         (else)

The fingerprint hashes the generator format, the shape parameters and the versions of the
libraries whose output ends up in the files (transformers writes config.json, tokenizers trains the
vocabulary, torch draws the numbers), so an upgrade gets a fresh snapshot instead of a stale one.
The directory is built beside its final place and renamed into it, so a crash or two workers
starting at once never leave a half-written snapshot behind.

Tensor names and shapes come from transformers itself (the backbone, built on the meta device from
the generated config) and from torch modules laid out as spec §4.1 describes (the head), so they
match what a loader expects by construction. One subtlety: importing transformers' Qwen3.5
modelling module binds the Gated DeltaNet kernel (fla or torch) for the life of the process, and
the native executor wants to make that choice itself (`--gdn-prefill`). So the backbone's layout
is read in-process only when that import cannot change anything (the module is already imported,
or fla and causal_conv1d are absent or blocked); otherwise a short-lived child process reads it
with them blocked.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clef_worker.executor import StartupError

log = logging.getLogger(__name__)

DEMO_FORMAT = 1
"""Bump when the generator's output changes for the same library versions."""

MARKER = "TINY_RANDOM_MODEL.txt"
"""Marker file of randomly initialised snapshots (the shared fixture uses the same name)."""

CACHE_ENV = "CLEF_SERVE_CACHE"

_STALE_TEMP_SECONDS = 3600.0
_MODELLING_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
_KERNEL_PACKAGES = ("fla", "causal_conv1d")

# Special tokens of the Qwen3.5 tokenizer that a Clef prompt or a media record may contain, in the
# order they are appended after the trained vocabulary. (special, text)
_SPECIAL_TOKENS: tuple[tuple[bool, str], ...] = (
    (True, "<|endoftext|>"),
    (True, "<|im_start|>"),
    (True, "<|im_end|>"),
    (True, "<|object_ref_start|>"),
    (True, "<|object_ref_end|>"),
    (True, "<|box_start|>"),
    (True, "<|box_end|>"),
    (True, "<|quad_start|>"),
    (True, "<|quad_end|>"),
    (True, "<|vision_start|>"),
    (True, "<|vision_end|>"),
    (True, "<|vision_pad|>"),
    (True, "<|image_pad|>"),
    (True, "<|video_pad|>"),
    (False, "<tool_call>"),
    (False, "</tool_call>"),
    (False, "<think>"),
    (False, "</think>"),
)

# The tokenizer's training text. Written for this project: the phrases a Clef prompt is made of
# (so the fixed pieces encode to few tokens, like with the real vocabulary), plus varied English,
# JSON and numbers (so client text does not fall back to single bytes everywhere).
_CORPUS: tuple[str, ...] = (
    "Read the complete state and schema. Decide every field jointly. Each answer must be exactly "
    "one of that field's allowed options.",
    "system\nuser\nassistant\nSTATE:\n\n\nSCHEMA FIELDS:\n",
    "\nFIELD 1\nID: intent\nTYPE: choice\nINSTRUCTION: What does the user want?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"Buy something","option_id":"buy"}\n'
    'OPTION 2: {"description":"Ask a question","option_id":"ask"}\nEND FIELD\n',
    "\nFIELD 2\nID: urgent\nTYPE: noul\nINSTRUCTION: Is the request urgent?\nALLOWED OPTIONS:\n"
    'OPTION 1: {"description":"The proposition is true or the answer is yes.",'
    '"option_id":"true"}\nOPTION 2: {"description":"The proposition is false or the answer is '
    'no.","option_id":"false"}\n'
    "END FIELD\n",
    "\nFIELD 3\nID: quality\nTYPE: score\nINSTRUCTION: Rate the quality of the answer.\n"
    'ALLOWED OPTIONS:\nOPTION 1: {"description":"poor","option_id":"0"}\n'
    'OPTION 2: {"description":"fair","option_id":"1"}\nOPTION 3: {"description":"good",'
    '"option_id":"2"}\nOPTION 4: {"description":"excellent","option_id":"3"}\nEND FIELD\n',
    "\nJOINT SCHEMA DECISIONS:",
    '{"model":"clef-flash","state":{"user":"Hello, I would like to return my order.","history":[]},'
    '"questions":{"sentiment":{"type":"choice","criteria":{"positive":"The user is happy",'
    '"negative":"The user is upset","neutral":null}}}}',
    "The customer wrote to the support team because the package arrived late and the box was "
    "damaged. They asked for a refund or a replacement, whichever is faster.",
    "A ticket is urgent when the service is down, when money was charged twice, or when the "
    "user cannot log in to their account at all.",
    "Please classify the message, decide whether it needs a human, and rate the tone from one to "
    "five. Answer with the option that fits best.",
    "The weather today is sunny with a light wind from the north; tomorrow there will be rain in "
    "the morning and clouds in the afternoon.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 15 20 25 42 50 64 100 128 255 256 1000 1024 2048 4096 "
    "3.14 0.5 -1 1e-5 2024-05-17 12:30:00",
    "true false null yes no maybe unknown none other all some every each first last next",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Is the proposition true? Does the document mention a price? Which category applies? How "
    "confident is the reviewer? Should the request be escalated?",
    "The assistant reads the state, compares it with the instructions of every field, and picks "
    "one allowed option for each field at the same time.",
    "error warning info debug request response status code message detail timeout retry limit",
    "Der Kunde möchte wissen, wann die Lieferung ankommt. Le client veut savoir quand la livraison "
    "arrive. El cliente quiere saber cuándo llega el pedido.",
)


@dataclass(frozen=True)
class DemoSpec:
    """Shape parameters of a generated snapshot; the default is the tiny `--model demo` one."""

    hidden_size: int = 64
    num_layers: int = 4
    full_attention_interval: int = 4
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_head_dim: int = 16
    head_width: int = 32
    head_routing_layers: int = 2
    head_layers: int = 2
    head_heads: int = 4
    head_feedforward: int = 64
    tokenizer_vocab: int = 1024
    seed: int = 0

    @classmethod
    def wide(cls) -> DemoSpec:
        """A wider random model for benchmarks: real-ish per-token widths, few layers."""
        return cls(
            hidden_size=1024,
            num_layers=4,
            intermediate_size=3072,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=8,
            linear_num_value_heads=16,
            linear_head_dim=64,
            head_width=256,
            head_routing_layers=2,
            head_layers=2,
            head_heads=4,
            head_feedforward=1024,
        )


# ---------------------------------------------------------------------------------------------
# Cache


def default_cache_root() -> Path:
    """Where cached demo snapshots live (see the module docstring for the order of precedence)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "clef-serve"


def _library_versions() -> dict[str, str]:
    versions = {}
    for name in ("torch", "transformers", "tokenizers", "safetensors"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def demo_snapshot_name(spec: DemoSpec = DemoSpec()) -> str:
    """The cache directory name: format version plus a fingerprint of everything that shapes it."""
    identity = json.dumps(
        {"format": DEMO_FORMAT, "spec": asdict(spec), "versions": _library_versions()},
        sort_keys=True,
    )
    return f"demo-v{DEMO_FORMAT}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def ensure_demo_snapshot(
    cache_dir: Path | None = None,
    spec: DemoSpec = DemoSpec(),
) -> Path:
    """Return the cached demo snapshot directory, generating it first if it is not there yet.

    `cache_dir` is the cache *root* (default `default_cache_root()`); the snapshot is the
    `demo-v<FORMAT>-<fingerprint>` directory inside it. Raises StartupError (shown to the
    operator) when the snapshot cannot be generated, e.g. the cache is not writable.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / demo_snapshot_name(spec)
    if (final / MARKER).is_file():
        log.info("demo snapshot: using cached %s", final)
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root, final.name)
        temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    except OSError as exc:
        raise StartupError(f"cannot create the demo snapshot cache {root}: {exc}") from exc
    try:
        started = time.perf_counter()
        generate_snapshot(temp, spec)
        _fsync_tree(temp)
        try:
            os.rename(temp, final)
        except OSError:
            # Another process finished first (the target exists and is not empty): use theirs.
            if not (final / MARKER).is_file():
                raise
            log.info("demo snapshot: another process generated %s first", final)
        else:
            _fsync_dir(root)
            log.info("demo snapshot: generated %s in %.1f s", final,
                     time.perf_counter() - started)
    except Exception as exc:
        raise StartupError(f"cannot generate the demo snapshot in {root}: {exc}") from exc
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


def _remove_stale_temps(root: Path, name: str) -> None:
    """Delete build directories left by crashed generators (old enough not to be in progress)."""
    now = time.time()
    for entry in root.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Make the files durable before the rename publishes them (a crash must not expose zeros)."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)


# ---------------------------------------------------------------------------------------------
# Generation


def generate_snapshot(dest: Path, spec: DemoSpec = DemoSpec()) -> Path:
    """Write a random snapshot in release layout into `dest` (created if needed; must be empty).

    No caching and no atomicity here: `ensure_demo_snapshot` adds both. Benchmarks and tests call
    this directly to build variants in a temporary directory.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")

    tokenizer = build_tokenizer(spec.tokenizer_vocab)
    token_ids = {text: tokenizer.token_to_id(text) for _, text in _SPECIAL_TOKENS}
    vocab_rows = _round_up(tokenizer.get_vocab_size(with_added_tokens=True), 128)

    config_text = _config_json(spec, vocab_rows, token_ids)
    layout = _backbone_layout(config_text)

    _write_text(dest / "tokenizer.json", tokenizer.to_str(pretty=True) + "\n")
    _write_json(dest / "tokenizer_config.json", _tokenizer_config())
    _write_text(dest / "config.json", config_text)
    _write_json(dest / "generation_config.json", {
        "do_sample": False,
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
    })
    head_config = {
        "hidden_size": spec.hidden_size,
        "width": spec.head_width,
        "routing_layers": spec.head_routing_layers,
        "layers": spec.head_layers,
        "heads": spec.head_heads,
        "feedforward": spec.head_feedforward,
    }
    _write_json(dest / "joint_head_config.json", head_config)
    _save_tensors(dest / "model.safetensors", layout, spec.seed)
    _save_tensors(dest / "joint_head.safetensors", _head_layout(head_config), spec.seed)
    _write_text(dest / MARKER, _marker_text())
    return dest


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _write_text(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8"))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    _write_text(path, json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _marker_text() -> str:
    versions = ", ".join(f"{name} {version}" for name, version in _library_versions().items())
    return (
        "Randomly initialised demo snapshot generated by clef-serve, not a real Clef model.\n"
        "Its answers are meaningless; only the arithmetic is real.\n"
        f"Generator format {DEMO_FORMAT}; {versions}.\n"
    )


def build_tokenizer(vocab_size: int = 1024) -> Any:
    """Train a byte-level BPE (Qwen-style pre-tokenisation) on the built-in corpus.

    The special tokens are appended after the trained vocabulary, as in the Qwen release, so that
    their text inside any prompt piece encodes to one id each.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_pretokenize_regex()), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    for special, text in _SPECIAL_TOKENS:
        token = AddedToken(text, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


def _pretokenize_regex() -> str:
    """The Qwen3.5 split pattern, read from transformers rather than restated here."""
    from transformers.models.qwen3_5 import tokenization_qwen3_5

    return str(tokenization_qwen3_5.PRETOKENIZE_REGEX)


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "image_token": "<|image_pad|>",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "TokenizersBackend",
        "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>",
        "vision_eos_token": "<|vision_end|>",
    }


def _config_json(spec: DemoSpec, vocab_rows: int, token_ids: dict[str, int]) -> str:
    """config.json as transformers writes it for a Qwen3.5 text+vision model."""
    from transformers import Qwen3_5Config

    layer_types = [
        "full_attention" if (i + 1) % spec.full_attention_interval == 0 else "linear_attention"
        for i in range(spec.num_layers)
    ]
    text_config = {
        "vocab_size": vocab_rows,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_key_head_dim": spec.linear_head_dim,
        "linear_value_head_dim": spec.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "layer_types": layer_types,
        "max_position_embeddings": 32768,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "eos_token_id": token_ids["<|im_end|>"],
        "pad_token_id": token_ids["<|endoftext|>"],
        "bos_token_id": None,
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": spec.hidden_size,
        "num_position_embeddings": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    config.dtype = "bfloat16"
    return str(config.to_json_string(use_diff=True))


# A tensor to generate: name -> (shape, kind). `kind` picks the initialisation (see _draw).
Layout = dict[str, tuple[tuple[int, ...], str]]

def _backbone_layout(config_text: str) -> Layout:
    """Names, shapes and init kinds of the backbone tensors, as transformers lays them out."""
    if _modelling_import_is_harmless():
        return _layout_from_config_text(config_text)
    return _layout_in_child(config_text)


def _modelling_import_is_harmless() -> bool:
    """True when importing the Qwen3.5 modelling module now binds what any guard would bind.

    That is: it is already imported, or each optional kernel package it binds at import (fla, and
    causal_conv1d, which the native executor blocks on CPU) is either blocked or not installed.
    """
    if _MODELLING_MODULE in sys.modules:
        return True
    return all(_blocked_or_absent(package) for package in _KERNEL_PACKAGES)


def _blocked_or_absent(package: str) -> bool:
    if package in sys.modules:
        return sys.modules[package] is None
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):
        return False


def _layout_in_child(config_text: str) -> Layout:
    with tempfile.TemporaryDirectory(prefix="clef-demo-layout-") as work:
        config_path = Path(work) / "config.json"
        out_path = Path(work) / "layout.json"
        config_path.write_text(config_text, encoding="utf-8")
        code = (
            'import sys\n'
            f"for name in {_KERNEL_PACKAGES!r}: sys.modules[name] = None\n"
            "import importlib.util, pathlib, json\n"
            f"spec = importlib.util.spec_from_file_location('_clef_demo', {str(__file__)!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "sys.modules['_clef_demo'] = module\n"
            "spec.loader.exec_module(module)\n"
            "text = pathlib.Path(sys.argv[1]).read_text(encoding='utf-8')\n"
            "layout = module._layout_from_config_text(text)\n"
            "pathlib.Path(sys.argv[2]).write_text(json.dumps(layout), encoding='utf-8')\n"
        )
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, "-c", code, str(config_path), str(out_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, check=False,
        )
        if result.returncode != 0:
            tail = result.stderr.decode("utf-8", "replace")[-2000:]
            raise RuntimeError(f"reading the Qwen3.5 tensor layout failed:\n{tail}")
        raw = json.loads(out_path.read_text(encoding="utf-8"))
    return {name: (tuple(shape), kind) for name, (shape, kind) in raw.items()}


def _layout_from_config_text(config_text: str) -> Layout:
    """Build Qwen3_5ForConditionalGeneration on the meta device and list its tensors."""
    import torch
    from torch import nn
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    config = Qwen3_5Config.from_dict(json.loads(config_text))
    with torch.device("meta"):
        model = qwen.Qwen3_5ForConditionalGeneration(config)
    layout: Layout = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, qwen.Qwen3_5RMSNorm):
                kind = "centred_norm"  # applied as (1 + weight)
            elif isinstance(module, qwen.Qwen3_5RMSNormGated | nn.LayerNorm):
                kind = "norm_" + param_name
            elif isinstance(module, qwen.Qwen3_5GatedDeltaNet) and param_name in ("A_log",
                                                                                  "dt_bias"):
                kind = param_name
            elif isinstance(module, nn.Embedding) or name == "lm_head.weight":
                kind = "pos_embedding" if "visual" in name else "token_table"
            else:
                kind = "weight" if param.dim() >= 2 else "bias"
            layout[name] = (tuple(param.shape), kind)
    expected = set(model.state_dict())
    if set(layout) != expected:
        raise RuntimeError(f"tensor layout mismatch: {sorted(set(layout) ^ expected)[:5]}")
    return layout


def _head_layout(head_config: dict[str, int]) -> Layout:
    """The joint head's tensors (spec §4.1), laid out by the torch modules the spec names."""
    import torch
    from torch import nn

    hidden = head_config["hidden_size"]
    width = head_config["width"]
    heads = head_config["heads"]
    feedforward = head_config["feedforward"]

    def evidence_layer() -> nn.Module:
        layer = nn.Module()
        layer.query_norm = nn.LayerNorm(width)
        layer.memory_norm = nn.LayerNorm(width)
        layer.feedforward_norm = nn.LayerNorm(width)
        layer.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        layer.feedforward = nn.Sequential(
            nn.Linear(width, feedforward), nn.GELU(), nn.Dropout(0.0),
            nn.Linear(feedforward, width), nn.Dropout(0.0),
        )
        return layer

    with torch.device("meta"):
        head = nn.Module()
        head.hidden_norm = nn.LayerNorm(hidden)
        for name in ("memory_projection", "question_projection", "option_question_projection",
                     "global_projection", "option_context_projection",
                     "option_lexical_projection"):
            setattr(head, name, nn.Linear(hidden, width, bias=False))
        head.type_embedding = nn.Embedding(3, width)
        head.evidence_layers = nn.ModuleList(
            evidence_layer() for _ in range(head_config["routing_layers"])
        )
        head.option_summary_norm = nn.LayerNorm(width)
        head.field_norm = nn.LayerNorm(width)
        head.option_norm = nn.LayerNorm(width)
        head.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                d_model=width, nhead=heads, dim_feedforward=feedforward, dropout=0.0,
                activation="gelu", batch_first=True, norm_first=True,
            )
            for _ in range(head_config["layers"])
        )
        head.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width), nn.GELU(), nn.Dropout(0.0), nn.Linear(width, 1),
        )
        for name in ("prior_logit_scale", "joint_logit_scale", "residual_gate"):
            setattr(head, name, nn.Parameter(torch.zeros(())))

    layout: Layout = {}
    for module_name, module in head.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.LayerNorm):
                kind = "norm_" + param_name
            elif name == "type_embedding.weight":
                kind = "type_embedding"
            elif param.dim() == 0:
                kind = "scalar_" + param_name
            else:
                kind = "weight" if param.dim() >= 2 else "bias"
            layout[name] = (tuple(param.shape), kind)
    return layout


# Head scalars, chosen so that the lexical prior and the joint score both move the logits by a
# few units on random inputs: probabilities vary between options without saturating.
_SCALARS = {
    "prior_logit_scale": math.log(8.0),
    "joint_logit_scale": math.log(8.0),
    "residual_gate": 0.5,
}


def _draw(name: str, shape: tuple[int, ...], kind: str, seed: int) -> Any:
    """One tensor, from its own RNG stream keyed by (seed, name): independent of the others.

    Scales keep every activation near unit size (weights ~ N(0, 1/fan_in)), so a random model
    gives finite, varied answers rather than NaNs or one-hot probabilities.
    """
    import torch

    generator = torch.Generator().manual_seed(seed * 0x9E3779B1 + zlib.crc32(name.encode()))

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float32) * std

    if kind == "centred_norm":
        return normal(0.1)
    if kind == "norm_weight":
        return 1.0 + normal(0.1)
    if kind == "norm_bias":
        return normal(0.05)
    if kind == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
    if kind == "dt_bias":
        return 1.0 + normal(0.2)
    if kind == "token_table":
        return normal(1.0)
    if kind in ("pos_embedding", "bias"):
        return normal(0.02)
    if kind == "type_embedding":
        return normal(1.0)
    if kind.startswith("scalar_"):
        return torch.full(shape, _SCALARS[kind.removeprefix("scalar_")])
    if kind == "weight":
        fan_in = math.prod(shape[1:])
        return normal(1.0 / math.sqrt(fan_in))
    raise ValueError(f"unknown init kind {kind!r} for {name}")


def _save_tensors(path: Path, layout: Layout, seed: int) -> None:
    """Draw every tensor in float32 and store it in BF16, as the release does."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        name: _draw(name, shape, kind, seed).to(torch.bfloat16).contiguous()
        for name, (shape, kind) in sorted(layout.items())
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def snapshot_files(directory: Path) -> Iterable[Path]:
    """The files of a snapshot, sorted: for hashing and listing."""
    return sorted(p for p in Path(directory).iterdir() if p.is_file())

"""Clef-Flash's real shapes with random weights, built in memory, served by the real loader.

No real weights can be downloaded on a GPU host, and writing then reading an 18 GB random
snapshot would spend the device's time on disk I/O. So this builds the text stack from a Qwen3.5
config with the release's shapes (H 4096, 32 layers, 24 Gated DeltaNet + 8 full attention, vocab
248,320) directly on the device, a head with the release's head shapes and a random lexical
table, and hands them to the worker's own `assemble_snapshot` in place of the snapshot's
tensors (`install`). Everything else is the worker's: the demo snapshot's tokenizer and layout,
the Gated DeltaNet binding, length buckets, CUDA graphs, warm-up, `describe()`. Compute per
token is the release's; only the numbers in the weights are random, and the demo tokenizer is
small, so requests are padded to the token counts that matter (`make_request`).

Used in process by the executor benchmarks (`load_executor`) and, through
`benchlib/flash_worker.py`, as the worker of a real `clef-serve` for measurements over HTTP.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

log = logging.getLogger("benchlib.flash_model")

FLASH = {
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 12288,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "vocab_size": 248320,
}
FLASH_HEAD = {"hidden_size": 4096, "width": 1024, "routing_layers": 2, "layers": 4,
              "heads": 16, "feedforward": 4096}
SMALL = {
    "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "vocab_size": 4096,
}
SMALL_HEAD = {"hidden_size": 256, "width": 64, "routing_layers": 2, "layers": 2, "heads": 4,
              "feedforward": 128}
SHAPES = {"flash": (FLASH, FLASH_HEAD), "small": (SMALL, SMALL_HEAD)}
BUILT = "built %s-shaped stack"  # the log line that proves the in-memory model is the one served
# Where the executor's assembly (clef_worker.assembly) looks its two tensor loaders up
# (replaced by `install`).
LOADER_MODULE = "clef_worker.assembly"
LOADERS = ("load_backbone", "load_head")


def text_config(shape: dict[str, int]) -> dict[str, Any]:
    layers = shape["num_hidden_layers"]
    return {
        **shape,
        "model_type": "qwen3_5_text",
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None,
    }


class InMemoryModel:
    """Builds the random stack once, on first use, and hands the same tensors to every load in
    this process (eager and graphs executors then share one set of weights)."""

    def __init__(self, shape: str = "flash", layers: int = 0) -> None:
        self.shape = shape
        self.layers = layers
        self.parameters = 0
        self._built: dict[tuple[str, str], Any] = {}

    def _shapes(self) -> tuple[dict[str, int], dict[str, int]]:
        text, head = SHAPES[self.shape]
        return ({**text, "num_hidden_layers": self.layers} if self.layers else text), head

    def load_backbone(self, snapshot: Any, device: Any, dtype: Any, gdn_path: str) -> Any:
        """In place of `clef_worker.model.backbone.load_backbone` (same signature)."""
        key = ("backbone", f"{device}/{dtype}/{gdn_path}")
        if key not in self._built:
            self._built[key] = self._build_backbone(device, dtype, gdn_path)
        return self._built[key]

    def load_head(self, snapshot: Any, device: Any, dtype: Any) -> Any:
        """In place of `clef_worker.assembly.load_head` (same signature)."""
        import torch

        from clef_worker.model.head import HeadConfig, JointSchemaHead

        key = ("head", f"{device}/{dtype}")
        if key not in self._built:
            torch.manual_seed(1)
            with _default_dtype(dtype), torch.device(device):
                head = JointSchemaHead(HeadConfig(**self._shapes()[1]))
            self._built[key] = head.eval().requires_grad_(False)
        return self._built[key]

    def _build_backbone(self, device: Any, dtype: Any, gdn_path: str) -> Any:
        import torch
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

        from clef_worker.model.backbone import Backbone, configure_attention

        configure_attention(device)  # as load_backbone does
        text, _ = self._shapes()
        started = time.perf_counter()
        torch.manual_seed(0)
        with _default_dtype(dtype), torch.device(device):
            model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config(text)))
            lexical = torch.randn(text["vocab_size"], text["hidden_size"]) * 0.02
        # Random init leaves the norms at their defaults: fine for timing.
        model.eval().requires_grad_(False)
        self.parameters = sum(p.numel() for p in model.parameters())
        log.info(BUILT + " (%d layers, %.2f B parameters) on %s in %.1f s", self.shape,
                 text["num_hidden_layers"], self.parameters / 1e9, device,
                 time.perf_counter() - started)
        return Backbone(model=model, lexical_table=lexical, device=device, dtype=dtype,
                        gdn_path=gdn_path)


class _default_dtype:
    """torch's default dtype for the duration of a block (modules built in it take it)."""

    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype

    def __enter__(self) -> None:
        import torch

        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        import torch

        torch.set_default_dtype(self.previous)


def install(model: InMemoryModel) -> None:
    """Make `clef_worker.assembly.assemble_snapshot` take its backbone and head from `model`.
    RuntimeError when the loader no longer looks them up where this expects: a benchmark must
    not silently serve the tiny demo model under a Flash-shaped label."""
    import importlib

    module = importlib.import_module(LOADER_MODULE)
    missing = [name for name in LOADERS if not callable(getattr(module, name, None))]
    if missing:
        raise RuntimeError(f"{LOADER_MODULE} has no {', '.join(missing)}: the in-memory "
                           "Flash-shaped model cannot be installed; update benchlib/flash_model.py")
    module.load_backbone = model.load_backbone  # type: ignore[attr-defined]
    module.load_head = model.load_head  # type: ignore[attr-defined]


def load_executor(model: InMemoryModel, args: argparse.Namespace, cuda_graphs: str) -> Any:
    """The worker's own executor over the in-memory model (`add_shape_arguments`' flags, and a
    `max_batch_tokens` where the script sets one), with `--cuda-graphs cuda_graphs` and media
    off."""
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot
    from clef_worker.demo import ensure_demo_snapshot

    install(model)
    executor = assemble_snapshot(
        ensure_demo_snapshot(), variant="clef-flash", device=args.device, dtype=args.dtype,
        gdn_prefill=args.gdn_prefill, short_conv=args.short_conv,
        limits=RequestLimits(max_length=args.max_length), demo=True, media="off",
        cuda_graphs=cuda_graphs, max_batch_tokens=getattr(args, "max_batch_tokens", 0))
    if not model.parameters:
        raise RuntimeError("assemble_snapshot did not take its backbone from the in-memory "
                           "model (the loader moved?): refusing to time the demo snapshot")
    return executor


def make_request(executor: Any, tokens: int, questions: int) -> dict[str, Any]:
    """A request of `questions` mixed questions whose encoding is about `tokens` long."""
    items: dict[str, Any] = {}
    for k in range(questions):
        kind = ("noul", "choice", "score")[k % 3]
        if kind == "noul":
            items[f"q{k}"] = {"type": "noul", "instructions": f"Does the ticket mention item {k}?"}
        elif kind == "choice":
            items[f"q{k}"] = {"type": "choice", "instructions": f"Which team handles part {k}?",
                              "criteria": {"billing": "payments", "delivery": "shipping",
                                           "product": "defects", "other": None}}
        else:
            items[f"q{k}"] = {"type": "score", "instructions": f"How severe is aspect {k}?",
                              "criteria": ["none", "low", "medium", "high"]}
    request = {"model": "bench", "state": "", "questions": items}
    base = len(executor.encode(request).input_ids)
    words = "the customer reports a delayed parcel and asks for a refund "
    state = ""
    while base + len(executor.encoder.tokenizer.encode(state, add_special_tokens=False).ids) \
            < tokens:
        state += words
    request["state"] = state
    return request


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the in-memory model and of the executor that serves it."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--short-conv", default="auto", help="auto, fla or torch")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="flash")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")


def apply_quick(args: argparse.Namespace) -> None:
    """--quick for the benchmarks built on this model: small shapes on CPU, float32 (a result
    file only where `--out` names one)."""
    args.device, args.shape, args.max_length = "cpu", "small", 512
    args.gdn_prefill, args.dtype = "torch", "float32"


class RequestSizer:
    """Token counts without a model: the demo snapshot's tokenizer and the worker's encoder,
    for building requests of a given length in a process that only speaks HTTP to the server
    (`make_request(RequestSizer(), tokens, questions)`)."""

    def __init__(self, max_length: int = 1 << 20) -> None:
        from clef_worker.demo import ensure_demo_snapshot
        from clef_worker.model.encoding import Encoder
        from clef_worker.model.snapshot import open_snapshot

        snapshot = open_snapshot(ensure_demo_snapshot(), variant="clef-flash", demo=True)
        self.encoder = Encoder.from_file(snapshot.tokenizer_file)
        self.max_length = max_length

    def encode(self, request: dict[str, Any]) -> Any:
        return self.encoder.encode(request, self.max_length, ())


def add_mode_arguments(parser: argparse.ArgumentParser, modes: list[str]) -> None:
    """`--modes`, `--out` and `--quick` of the benchmarks that compare eager and graphs."""
    parser.add_argument("--modes", nargs="+", choices=("eager", "graphs"), default=modes,
                        help="in this order: the first pays the cold kernel compilation")
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: small shapes, few iterations, no file")


def executor_for_mode(model: InMemoryModel, args: argparse.Namespace, mode: str) -> Any:
    """The worker's executor in `mode` (eager: `--cuda-graphs off`; graphs: `on`). The
    capture environment is set before the first load whenever graphs are among the modes,
    because it must precede fla's import."""
    if "graphs" in args.modes:
        from clef_worker.serving.gpu.capture import prepare_capture_environment

        prepare_capture_environment()
    return load_executor(model, args, "on" if mode == "graphs" else "off")

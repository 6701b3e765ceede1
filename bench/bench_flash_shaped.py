"""Time the native executor at Clef-Flash's real shapes, with random weights built in memory.

Not a test. No real weights can be downloaded here, and writing then reading an 18 GB random
snapshot would spend the GPU lease on disk I/O, so this builds the text stack from a Qwen3.5
config with the release's shapes (H 4096, 32 layers, 24 Gated DeltaNet + 8 full attention, vocab
248,320) directly on the device, a head with the release's head shapes, and a random lexical
table, and wraps them in the same `NativeExecutor` the worker uses. The tokenizer is the demo
snapshot's (a small byte-level BPE), so requests are padded to the token counts that matter.
Compute per token is the release's; only the numbers in the weights are random.

    python bench/bench_flash_shaped.py --device cuda --gdn-prefill fla --out results.json
    python bench/bench_flash_shaped.py --device cpu --shape small     # a dry run of the code path
    python bench/bench_flash_shaped.py --quick       # CI smoke run: small, 2 layers, CPU, no file

What it reports (medians over --repeat after warm-up): per-request wall time of
`NativeExecutor.answer` for typical sizes (tokens, questions), and the stage split from
`score(profile=True)`; the first request at a long length before warm-up (fla autotuning); the
warm-up time; and the same request answered from a fresh thread each time (the old server's
shape) against the executor's own thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchlib.provenance import command_line

log = logging.getLogger("bench_flash_shaped")

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

# (label, target tokens, questions): typical requests are 150-600 tokens; 64-question requests
# reach about 6,500 tokens (clef-model.md §6).
CASES = [("1q-300tok", 300, 1), ("3q-300tok", 300, 3), ("8q-1000tok", 1000, 8),
         ("16q-2000tok", 2000, 16), ("64q-6500tok", 6500, 64)]


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


def build_executor(args: argparse.Namespace) -> Any:
    import torch

    from clef_protocol.options import RequestLimits
    from clef_worker.demo import ensure_demo_snapshot
    from clef_worker.model.backbone import (
        Backbone,
        bind_gdn_path,
        configure_attention,
        resolve_device,
        resolve_dtype,
    )
    from clef_worker.model.encoding import Encoder
    from clef_worker.model.head import HeadConfig, JointSchemaHead
    from clef_worker.model.short_conv import bind_short_conv
    from clef_worker.model.snapshot import open_snapshot
    from clef_worker.native import NativeExecutor

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    gdn_path = bind_gdn_path(args.gdn_prefill, device, dtype)
    short_conv = bind_short_conv(device, gdn_path, args.short_conv)  # as NativeExecutor.load
    configure_attention(device)  # as load_backbone does
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    shape, head_shape = (FLASH, FLASH_HEAD) if args.shape == "flash" else (SMALL, SMALL_HEAD)
    if args.layers:
        shape = {**shape, "num_hidden_layers": args.layers}
    started = time.perf_counter()
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config(shape)))
            head = JointSchemaHead(HeadConfig(**head_shape))
            lexical = torch.randn(shape["vocab_size"], shape["hidden_size"]) * 0.02
    finally:
        torch.set_default_dtype(previous)
    # Random init leaves the head's scalars and norms at their defaults: fine for timing.
    model.eval().requires_grad_(False)
    head.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    log.info("built %s-shaped stack (%.2f B parameters) + head on %s in %.1f s", args.shape,
             params / 1e9, device, time.perf_counter() - started)
    demo = ensure_demo_snapshot()
    snapshot = open_snapshot(demo, variant="clef-flash", demo=True)
    backbone = Backbone(model=model, lexical_table=lexical, device=device, dtype=dtype,
                        gdn_path=gdn_path)
    executor = NativeExecutor(snapshot=snapshot, encoder=Encoder.from_file(snapshot.tokenizer_file),
                              backbone=backbone, head=head,
                              limits=RequestLimits(max_length=args.max_length),
                              short_conv=short_conv)
    return executor, params


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


def timed_answer(executor: Any, body: bytes) -> float:
    started = time.perf_counter()
    executor.answer(body)  # ends with a device-to-host copy: synchronised
    return (time.perf_counter() - started) * 1000


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples), 2)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `build_executor` reads (shared with bench/bench_gpu_path.py)."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gdn-prefill", default="auto")
    parser.add_argument("--short-conv", default="auto", help="auto, fla or torch")
    parser.add_argument("--shape", choices=("flash", "small"), default="flash")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=0, help="override the layer count")


def add_mode_arguments(parser: argparse.ArgumentParser, modes: list[str]) -> None:
    """`--modes`, `--out` and `--quick` of the benches that compare eager and graphs."""
    parser.add_argument("--modes", nargs="+", choices=("eager", "graphs"), default=modes)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: small shapes, few iterations, no file")


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Write the results so far to `--out` (after each mode: a step cut short keeps them)."""
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def apply_quick(args: argparse.Namespace) -> None:
    """--quick for the benches built on `build_executor`: small shapes on CPU, no file."""
    args.device, args.shape, args.max_length, args.out = "cpu", "small", 512, None
    args.gdn_prefill, args.dtype = "torch", "float32"


def build_for_modes(args: argparse.Namespace) -> tuple[Any, int, dict[str, Any]]:
    """For the benches that compare `--modes eager graphs`: logging, the capture environment
    (before fla is imported, as NativeExecutor.load does), the executor and its parameter
    count, and the results skeleton those benches fill."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    args.skip_warmup_probe = True
    if "graphs" in args.modes:
        from clef_worker.gpu.graphs import prepare_capture_environment

        prepare_capture_environment()
    base, params = build_executor(args)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               "parameters": params, "modes": {}}
    return base, params, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-warmup-probe", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small shape, 2 layers, CPU, 2 short cases, 2 repeats, "
                             "no file written")
    args = parser.parse_args()
    fresh_extras: tuple[int, ...] = (7, 131, 517, 1033, 2111)
    cases, thread_repeats = CASES, 10
    if args.quick:
        args.device, args.shape, args.layers, args.repeat = "cpu", "small", 2, 2
        args.skip_warmup_probe, args.out = True, None
        args.gdn_prefill, args.dtype = "torch", "float32"
        cases, fresh_extras, thread_repeats = CASES[:2], (7,), 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    executor, params = build_executor(args)
    info = executor.describe()
    # No host paths in a result: the command as re-run from the repository root, and the
    # snapshot by its directory name only.
    described = {**info.__dict__, "snapshot": Path(info.snapshot).name}
    results: dict[str, Any] = {"command": command_line(__file__), "parameters": params,
                               "info": described, "cases": {}}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    requests = {label: make_request(executor, tokens, q) for label, tokens, q in cases}
    bodies = {label: json.dumps(r).encode() for label, r in requests.items()}
    if not args.skip_warmup_probe:
        # The first request at a long length before any warm-up: what warm-up saves.
        results["cold_first_64q_ms"] = round(timed_answer(executor, bodies["64q-6500tok"]), 1)
        results["second_64q_ms"] = round(timed_answer(executor, bodies["64q-6500tok"]), 1)
        log.info("cold 64q: %s ms, then %s ms", results["cold_first_64q_ms"],
                 results["second_64q_ms"])
        save()
    started = time.perf_counter()
    executor.warm_up()
    results["warmup_ms"] = round((time.perf_counter() - started) * 1000, 1)
    save()
    for label, _tokens, _questions in cases:
        body = bodies[label]
        for _ in range(3):
            timed_answer(executor, body)
        wall = [timed_answer(executor, body) for _ in range(args.repeat)]
        stages: dict[str, list[float]] = {}
        for _ in range(max(3, args.repeat // 2)):
            for name, value in executor.score(requests[label], profile=True).timings_ms.items():
                stages.setdefault(name, []).append(value)
        results["cases"][label] = {
            "input_tokens": len(executor.encode(requests[label]).input_ids),
            "questions": len(requests[label]["questions"]),
            "answer_p50_ms": median_ms(wall),
            "answer_min_ms": round(min(wall), 2),
            "answer_max_ms": round(max(wall), 2),
            "stages_p50_ms": {name: median_ms(v) for name, v in stages.items()},
        }
        log.info("%s: %s", label, results["cases"][label])
        save()
    # After warm-up, a length never seen before must cost what a seen one costs: no plan
    # building or autotuning left for the first request at that length.
    fresh: dict[str, list[float]] = {}
    base = requests["3q-300tok"]
    for extra in fresh_extras:
        request = {**base, "state": base["state"] + " word" * extra}
        tokens = len(executor.encode(request).input_ids)
        first = timed_answer(executor, json.dumps(request).encode())
        again = timed_answer(executor, json.dumps(request).encode())
        fresh[str(tokens)] = [round(first, 1), round(again, 1)]
    results["fresh_length_first_then_again_ms"] = fresh
    log.info("fresh lengths: %s", fresh)
    save()
    # The old server's shape: each request on a fresh thread.
    body = bodies["3q-300tok"]
    on_new_thread: list[float] = []
    for _ in range(min(args.repeat, thread_repeats)):
        box: list[float] = []
        thread = threading.Thread(target=lambda out=box: out.append(timed_answer(executor, body)))
        thread.start()
        thread.join()
        on_new_thread.append(box[0])
    results["fresh_thread_3q_p50_ms"] = median_ms(on_new_thread)
    results["main_thread_3q_p50_ms"] = results["cases"]["3q-300tok"]["answer_p50_ms"]
    save()
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

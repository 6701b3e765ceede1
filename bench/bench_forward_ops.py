"""Operations per packed forward on CPU, the elementwise set as torch ops against fla's fused
kernels (clef_worker.model.fused): a count that moves with the GPU's kernels per forward.

Not a test, and **not the GPU kernel count**: on CPU it counts every aten operation that
computes something (views, reshapes and empty allocations excluded: they launch nothing on a
GPU either) plus every Triton kernel launched, with fla's kernels run under Triton's interpreter
(`TRITON_INTERPRET=1`, set here before fla is imported; the harness is
`tests/fla_interpreter.py`'s). The GPU differs in the details: a matmul may be more than one
kernel, attention here is one SDPA per sequence where CUDA runs one `varlen_attn`, CUDA's
caching allocator and copies differ. The difference between the two rows is what the fused set
removes; the profile step of `bench/gpu_session.sh` counts the real kernels.

The forward is the one the CUDA graphs capture: the fla path's kernels (`kernels_for` on the
fla path: fla's varlen delta rule and short convolution), a static packed row (the graphs'
layout: sequences aligned to 64, a tail, empty slots) of `--tokens` tokens holding requests of
`--lengths`, at narrow widths (counts do not depend on widths) and at two depths (4 and 8 layers,
Clef-Flash's 3:1 Gated DeltaNet to attention); the per-forward figure is extrapolated to
Clef-Flash's 32 layers from the difference.

    python bench/bench_forward_ops.py          # writes bench/results/cpu-forward-ops.json
    python bench/bench_forward_ops.py --quick  # CI smoke run (64 tokens, one depth, no file)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.provenance import command_line

FLASH_LAYERS = 32
DEPTHS = (4, 8)
RESULT = Path(__file__).resolve().parent / "results" / "cpu-forward-ops.json"
# aten operations that compute nothing: views, metadata, allocation without a fill.
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "transpose", "t",
    "permute", "unsqueeze", "squeeze", "expand", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind", "alias", "detach", "empty", "empty_like", "empty_strided", "lift_fresh",
    "view_as", "unfold", "diagonal", "narrow", "_to_copy_noop", "resolve_conj", "resolve_neg",
    "is_same_size", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride",
    "reshape_as", "new_empty", "new_empty_strided", "contiguous_noop",
}


@contextmanager
def counting() -> Iterator[Counter[str]]:
    """Count aten operations that compute (by name) and Triton launches (as `triton:<kernel>`)
    while the block runs."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    counts: Counter[str] = Counter()
    inside = [False]  # in a Triton launch: the interpreter's own tensor work is not counted

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL and not inside[0]:
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    launch = interpreter.GridExecutor.__call__

    def counted_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["triton:" + getattr(self.fn, "__name__", "kernel")] += 1
        inside[0] = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            inside[0] = False

    interpreter.GridExecutor.__call__ = counted_launch
    try:
        with Ops():
            yield counts
    finally:
        interpreter.GridExecutor.__call__ = launch


# Narrow widths (every program instance runs in Python under the interpreter); the counts do
# not depend on widths.
NARROW = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "vocab_size": 512,
}


def small_shape(layers: int) -> dict[str, int]:
    return {**NARROW, "num_hidden_layers": layers}


def build(layers: int) -> Any:
    import torch
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    from benchlib.flash_model import text_config

    torch.manual_seed(0)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**text_config(small_shape(layers))))
    return model.eval().requires_grad_(False)


def count_forward(layers: int, tokens: int, lengths: list[int], kernels: Any) -> Counter[str]:
    import torch

    from clef_worker.model.packed import StaticPackedLayout
    from clef_worker.model.packed_layers import packed_forward

    model = build(layers)
    layout = StaticPackedLayout(tokens, max(16, len(lengths)), torch.device("cpu")).fill(lengths)
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        packed_forward(model, ids, layout, kernels)  # autotune and first-call work, uncounted
        with counting() as counts:
            packed_forward(model, ids, layout, kernels)
    return counts


def fla_path_kernels() -> tuple[Any, Any]:
    """The fla path's packed kernels with the torch elementwise set (before) and fla's
    (after)."""
    import torch

    from clef_worker.model import packed_kernels, short_conv, swap
    from clef_worker.model.fused import TORCH, fla_ops

    modeling = packed_kernels.modeling_module()
    swap.replace(modeling, short_conv.FUNCTION_NAME,
                 lambda original: short_conv.FlaShortConv(short_conv.load_fla_kernel(),
                                                          original))
    kernels = packed_kernels.kernels_for(torch.device("cpu"), torch.float32, "fla")
    return dataclasses.replace(kernels, fused=TORCH), dataclasses.replace(kernels,
                                                                           fused=fla_ops())


def per_forward(counts: dict[int, Counter[str]]) -> tuple[int, float]:
    """Total at the smaller depth, and extrapolated to Clef-Flash's layers."""
    low, high = DEPTHS
    small, large = sum(counts[low].values()), sum(counts[high].values())
    per_layer = (large - small) / (high - low)
    return small, small + per_layer * (FLASH_LAYERS - low)


def measure(tokens: int, lengths: list[int], depths: tuple[int, ...]) -> dict[str, Any]:
    before, after = fla_path_kernels()
    rows: dict[str, Any] = {}
    for label, kernels in (("torch_elementwise", before), ("fla_fused", after)):
        counts = {depth: count_forward(depth, tokens, lengths, kernels) for depth in depths}
        if len(depths) < 2:  # --quick: one depth, nothing to extrapolate from
            rows[label] = {"ops_by_depth": {str(d): sum(c.values()) for d, c in counts.items()}}
            print(f"{label:18s} {json.dumps(rows[label]['ops_by_depth'])}")
            continue
        at_low, flash = per_forward(counts)
        rows[label] = {
            "elementwise_set": kernels.fused.name,
            "ops_by_depth": {str(d): sum(c.values()) for d, c in counts.items()},
            "triton_launches_by_depth": {str(d): sum(n for k, n in c.items()
                                                     if k.startswith("triton:"))
                                         for d, c in counts.items()},
            f"ops_per_forward_{FLASH_LAYERS}_layers": round(flash),
            "top_ops_at_depth_4": dict(counts[depths[0]].most_common(12)),
        }
        print(f"{label:18s} {json.dumps(rows[label]['ops_by_depth'])} -> ~{round(flash)} per "
              f"{FLASH_LAYERS}-layer forward (at depth {depths[0]}: {at_low})")
    key = f"ops_per_forward_{FLASH_LAYERS}_layers"
    if len(depths) < 2:
        return {"rows": rows}
    ratio = rows["fla_fused"][key] / rows["torch_elementwise"][key]
    print(f"fused / torch: {ratio:.2f}")
    return {"rows": rows, "fused_over_torch": round(ratio, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=448, help="the static row's bucket")
    parser.add_argument("--lengths", default="393", help="comma-separated request lengths")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 64 tokens, no file")
    args = parser.parse_args(argv)
    if "fla" in sys.modules:
        raise SystemExit("fla was imported before the interpreter was switched on")
    os.environ["TRITON_INTERPRET"] = "1"  # before fla is imported (by the kernels below)
    from benchlib.triton_interpreter import prepare

    prepare()
    tokens, lengths = (64, [40]) if args.quick else (args.tokens,
                                                     [int(n) for n in args.lengths.split(",")])
    result = measure(tokens, lengths, DEPTHS[:1] if args.quick else DEPTHS)
    if args.quick:
        rows = result["rows"]
        depth = str(DEPTHS[0])
        fewer = (rows["fla_fused"]["ops_by_depth"][depth]
                 < rows["torch_elementwise"]["ops_by_depth"][depth])
        return 0 if fewer else 1
    result.update({
        "command": command_line("bench/bench_forward_ops.py", sys.argv[1:] if argv is None
                                else argv),
        "what": "aten ops that compute + Triton launches per packed forward on CPU (fla under "
                "Triton's interpreter); not the GPU kernel count",
        "tokens": tokens, "lengths": lengths, "shape": small_shape(DEPTHS[0]),
    })
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""clef's small-chunk Gated DeltaNet kernel against transformers' torch fallback, one layer on CPU.

Not a test. Times `clef_worker.model.gated_delta.chunked_gated_delta_rule` (at the chunk size it
picks for the row count, and at 16, 32 and 64) against transformers' `torch_chunk_gated_delta_rule`
(chunks of 64) on random q/k/v/g/beta of a layer's shapes: the tiny fixture's (2 key heads, 4 value
heads, 16 wide) and the release's (16 key heads, 32 value heads, 128 wide). Prints the best of
`--repeat` runs in ms per row.

    python bench/bench_gated_delta.py --threads 1
    python bench/bench_gated_delta.py --quick        # CI smoke run
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.timing import best_ms
from clef_worker.model import gated_delta
from clef_worker.model.kernel_choice import block_fla
from clef_worker.model.module_names import MODELING_MODULE

SHAPES = {"tiny": (2, 4, 16), "release": (16, 32, 128)}  # key heads, value heads, head width


def time_layer(reference: Callable[..., object], inputs: tuple[torch.Tensor, ...],
               repeat: int) -> dict[str, float]:
    """Best ms per call: transformers' function, then clef's at its own and at fixed chunks."""
    q, k, v, g, beta = inputs
    row = {"transformers": best_ms(lambda: reference(q, k, v, g=g, beta=beta,
                                                     use_qk_l2norm_in_kernel=True), repeat)}
    chunks: dict[str, int | None] = {"chosen": None, "16": 16, "32": 32, "64": 64}
    for label, chunk in chunks.items():
        row[label] = best_ms(functools.partial(
            gated_delta.chunked_gated_delta_rule, q, k, v, g, beta, chunk_size=chunk,
            use_qk_l2norm_in_kernel=True), repeat)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=436)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny", "release"])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="CI smoke run: tiny, few repeats")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.rows, args.shapes, args.repeat = 70, [1, 2], ["tiny"], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    block_fla()  # transformers' torch function, as a CPU worker has it
    module = importlib.import_module(MODELING_MODULE)
    gated_delta.uninstall(module)
    reference = module.torch_chunk_gated_delta_rule
    print("| shape | rows | transformers (C 64) | clef, chosen C | clef C 16 | clef C 32 | "
          "clef C 64 |\n|---|---:|---:|---:|---:|---:|---:|")
    results = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for shape in args.shapes:
            key_heads, value_heads, width = SHAPES[shape]
            for rows in args.rows:
                inputs = (
                    torch.randn(rows, args.tokens, key_heads, width, generator=generator),
                    torch.randn(rows, args.tokens, key_heads, width, generator=generator),
                    torch.randn(rows, args.tokens, value_heads, width, generator=generator),
                    -torch.rand(rows, args.tokens, value_heads, generator=generator) * 3,
                    torch.rand(rows, args.tokens, value_heads, generator=generator))
                row = time_layer(reference, inputs, args.repeat)
                per_row = {key: round(value / rows, 3) for key, value in row.items()}
                results.append({"shape": shape, "rows": rows, "ms_per_row": per_row})
                print(f"| {shape} | {rows} | " + " | ".join(
                    f"{per_row[key]}" for key in ("transformers", "chosen", "16", "32", "64"))
                    + " |", flush=True)
    print(json.dumps({"tokens": args.tokens, "threads": torch.get_num_threads(),
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

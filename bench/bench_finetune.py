"""What serving fine-tuned variants unmerged costs: time per forward and memory per variant.

Not a test. The model is benchlib/flash_model.py's (random weights at the `small` shapes on CPU,
Clef-Flash's on a GPU), served by the worker's own executor; the variants are random
clef-finetune checkpoints written for it (benchlib/synthetic_finetune.py: every linear layer of
the text stack adapted at `--rank`, and a head). One group of `--group` requests of about
`--tokens` tokens each is answered in one forward (`NativeExecutor.answer_prepared`, stage and
forward and head, as the worker runs a group), in rounds that take turns so a shared host's
noise falls on every row alike:

- `base, none loaded`: the executor without `--finetune` (its linear layers unwrapped; timed in
  its own rounds before the variants are attached, since they share one backbone);
- `base, variants loaded`: every request names the base on the executor with variants;
- `one variant`: every request names the first variant;
- `mixed`: the requests name the base and each variant in turn.

Each row reports the median and the fastest time per forward and their extra over `base, none
loaded`; then the memory each variant holds (its LoRA in the backbone's dtype and its head,
counted from the tensors; on CUDA also the allocator's growth while the variants were attached).

    python bench/bench_finetune.py                        # CPU, small shapes
    python bench/bench_finetune.py --device cuda --shape flash --rank 64 --out finetune.json
    python bench/bench_finetune.py --quick                # CI smoke run

On CUDA the variants run eagerly (no CUDA graphs with `--finetune` yet), so compare its rows
with each other, not with the graph-replay numbers of the other GPU benchmarks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import (
    InMemoryModel,
    add_shape_arguments,
    apply_quick,
    install,
    make_request,
)
from benchlib.provenance import command_line
from benchlib.synthetic_finetune import write_checkpoint
from benchlib.timing import timed_ms


def load(model: InMemoryModel, args: argparse.Namespace, finetunes: tuple[Any, ...]) -> Any:
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot
    from clef_worker.demo import ensure_demo_snapshot

    install(model)
    return assemble_snapshot(
        ensure_demo_snapshot(), variant="clef-flash", device=args.device, dtype=args.dtype,
        gdn_prefill=args.gdn_prefill, short_conv=args.short_conv,
        limits=RequestLimits(max_length=args.max_length), demo=True, media="off",
        cuda_graphs="off", finetunes=finetunes)


def allocated(device: str) -> int:
    import torch

    if not device.startswith("cuda"):
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.set_defaults(device="cpu", shape="small")
    parser.add_argument("--variants", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="requests per forward")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke run: small shapes, 2 layers, CPU, few rounds, no file")
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(args)
        args.layers, args.rounds, args.group, args.tokens, args.rank = 2, 1, 2, 120, 4
    if args.dtype == "auto":
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"

    from clef_protocol.finetune import Finetune

    model = InMemoryModel(args.shape, args.layers)
    plain = load(model, args, ())
    base_request = make_request(plain, args.tokens, 3)
    work = Path(tempfile.mkdtemp(prefix="bench-finetune-"))
    finetunes = tuple(
        Finetune(f"variant-{i}", write_checkpoint(
            work / f"variant-{i}", plain.backbone.model, plain.head, rank=args.rank,
            alpha=2.0 * args.rank, seed=i, dtype=plain.backbone.dtype))
        for i in range(args.variants))

    def group(models: list[str], executor: Any) -> list[Any]:
        return [executor.prepare(json.dumps(dict(base_request, model=name)).encode())
                for name in models]

    def forward(executor: Any, prepared: list[Any]) -> float:
        return timed_ms(lambda: executor.answer_prepared(prepared))

    names = ["clef-flash"] + [f.name for f in finetunes]
    rows: dict[str, list[float]] = {"base, none loaded": []}
    plain_group = group(["clef-flash"] * args.group, plain)
    forward(plain, plain_group)  # the first forward pays one-off costs
    for _ in range(args.rounds):
        rows["base, none loaded"].append(forward(plain, plain_group))

    before = allocated(args.device)
    served = load(model, args, finetunes)
    attached = allocated(args.device) - before
    groups = {
        "base, variants loaded": group(["clef-flash"] * args.group, served),
        "one variant": group([names[1]] * args.group, served),
        "mixed": group([names[i % len(names)] for i in range(args.group)], served),
    }
    for prepared in groups.values():
        forward(served, prepared)
    for _ in range(args.rounds):
        for label, prepared in groups.items():
            rows.setdefault(label, []).append(forward(served, prepared))

    reference = statistics.median(rows["base, none loaded"])
    fastest = min(rows["base, none loaded"])
    result: dict[str, Any] = {
        "command": command_line(__file__, argv),
        "device": args.device, "shape": args.shape, "dtype": args.dtype,
        "variants": args.variants, "rank": args.rank, "group": args.group,
        "tokens_per_request": len(served.encode(base_request).input_ids),
        "forward_ms": {label: round(statistics.median(times), 2) for label, times in rows.items()},
        "extra_over_base": {label: f"{statistics.median(times) / reference - 1:+.1%}"
                            for label, times in rows.items()},
        # The fastest round of each row: on a shared host the least disturbed.
        "fastest_ms": {label: round(min(times), 2) for label, times in rows.items()},
        "fastest_extra_over_base": {label: f"{min(times) / fastest - 1:+.1%}"
                                    for label, times in rows.items()},
        "memory_per_variant": [dict(name=item["name"], parameters=item["parameters"],
                                    memory_mib=round(item["memory_bytes"] / 2**20, 2))
                               for item in served.describe().finetunes],
        "allocator_growth_mib": round(attached / 2**20, 2) if attached else None,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if not all(rows.values()):
        print("no forward was timed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

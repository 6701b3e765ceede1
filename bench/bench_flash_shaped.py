"""Time the native executor at Clef-Flash's real shapes, with random weights built in memory.

Not a test. The model is benchlib/flash_model.py's: the release's shapes (H 4096, 32 layers,
24 Gated DeltaNet + 8 full attention, vocab 248,320) with random weights built on the device,
loaded through the worker's own `assemble_snapshot` (eager here). The tokenizer is the demo
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
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import InMemoryModel, add_shape_arguments, load_executor, make_request
from benchlib.provenance import command_line
from benchlib.timing import percentile, timed_ms

log = logging.getLogger("bench_flash_shaped")

# (label, target tokens, questions): typical requests are 150-600 tokens; 64-question requests
# reach about 6,500 tokens (docs/model.md, "Numbers measured by others").
CASES = [("1q-300tok", 300, 1), ("3q-300tok", 300, 3), ("8q-1000tok", 1000, 8),
         ("16q-2000tok", 2000, 16), ("64q-6500tok", 6500, 64)]


def timed_answer(executor: Any, body: bytes) -> float:
    return timed_ms(lambda: executor.answer(body))  # ends with a device-to-host copy


def median_ms(samples: list[float]) -> float:
    return round(percentile(samples, 0.5), 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--skip-warmup-probe", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small shape, 2 layers, CPU, 2 short cases, 2 repeats, "
                             "no file written")
    args = parser.parse_args(argv)
    fresh_extras: tuple[int, ...] = (7, 131, 517, 1033, 2111)
    cases, thread_repeats = CASES, 10
    if args.quick:
        args.device, args.shape, args.layers, args.repeat = "cpu", "small", 2, 2
        args.skip_warmup_probe, args.out = True, None
        args.gdn_prefill, args.dtype = "torch", "float32"
        cases, fresh_extras, thread_repeats = CASES[:2], (7,), 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    model = InMemoryModel(args.shape, args.layers)
    executor = load_executor(model, args, "off")
    params = model.parameters
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

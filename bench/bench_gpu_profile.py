"""The profile summary: where one short request's time goes on the device.

Not a test. Builds the Clef-Flash-shaped executor with random weights (benchlib/flash_model.py),
warms it up (in graphs mode: every bucket up to --max-length captured, checked: exit 1 when a
bucket is not), answers --warm requests
of --tokens tokens, then profiles --requests more with torch.profiler and prints markdown:

- wall time per request, and the device's busy and idle shares of it (kernel intervals merged
  within each request's window: the idle share is launch and host overhead the GPU waits on);
- kernel launches per request, as the device saw them (kernel events) and as the host issued
  them (`cudaLaunchKernel`-style runtime calls against `cudaGraphLaunch`);
- the top kernels by device time per request;
- `kernels_per_forward` (device kernels, copies left out: each request is one forward), device
  time per request by kernel class (`kernel_class`: matrix products, attention, norms, fla's
  Gated DeltaNet kernels, convolution, elementwise, copies), and where a graph replays, the
  replay's span and the device's idle time before it (host staging, input copies, the launch)
  and after it (the eager head, output copies, the host's sync): the graph's kernels are the
  ones whose correlation id is a `cudaGraphLaunch` call's (`replay_split`);
- the same over `--state-tokens` requests whose states are distinct and >= 256 tokens (`state`):
  each stores its points in the prefix cache, as users' first requests do, so this is the
  path a user's fresh request takes, not only the bare graph.

On CPU (--quick, or --device cpu) there is no device timeline: the same tables list torch ops by
self CPU time, and the busy/idle line is left out. The interval arithmetic is tested on CPU
(tests/test_bench_gpu_profile.py).

    python bench/bench_gpu_profile.py --device cuda --gdn-prefill fla --modes eager graphs
    python bench/bench_gpu_profile.py --quick        # CPU smoke run, small shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from benchlib.flash_model import (
    InMemoryModel,
    add_mode_arguments,
    add_shape_arguments,
    apply_quick,
    executor_for_mode,
    make_request,
)
from benchlib.gpu_checks import capture_problems
from benchlib.provenance import command_line

log = logging.getLogger("bench_gpu_profile")

REQUEST_RANGE = "clef_request"  # the record_function around each profiled request
# Host-side runtime calls that launch one kernel (the CUDA runtime and driver spellings).
KERNEL_LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                       "cuLaunchKernelEx")
GRAPH_LAUNCH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")


@dataclass(frozen=True)
class Interval:
    start_us: float
    end_us: float


def busy_us(kernels: Iterable[Interval], window: Interval) -> float:
    """Time within `window` during which at least one kernel ran (overlaps counted once)."""
    clipped = sorted((max(k.start_us, window.start_us), min(k.end_us, window.end_us))
                     for k in kernels)
    total = 0.0
    current_start = current_end = None
    for start, end in clipped:
        if end <= start:
            continue
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


def idle_fraction(kernels: Sequence[Interval], windows: Sequence[Interval]) -> float:
    """The share of the requests' wall time in which the device ran no kernel."""
    wall = sum(w.end_us - w.start_us for w in windows)
    if wall <= 0:
        return 0.0
    busy = sum(busy_us(kernels, window) for window in windows)
    return max(0.0, 1.0 - busy / wall)


def count_calls(names: Iterable[str], wanted: Sequence[str]) -> int:
    return sum(1 for name in names if name in wanted)


@dataclass(frozen=True)
class DeviceOp:
    """One device event: a kernel or a copy, its times, and the correlation id that ties it to
    the host call that launched it (a graph's kernels carry their `cudaGraphLaunch`'s)."""

    name: str
    start_us: float
    end_us: float
    correlation: int = 0


# Kernel classes by name, first match wins: where a forward's device time goes.
KERNEL_CLASSES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("copy", re.compile(r"^(Memcpy|Memset)")),
    ("gemm", re.compile(r"gemm|gemv|cutlass|cublas|nvjet|xmma|matmul|splitk", re.I)),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa", re.I)),
    ("norm", re.compile(r"norm|rms", re.I)),
    ("conv", re.compile(r"conv", re.I)),
    ("gated_delta", re.compile(r"chunk|recurrent|delta|recompute_w_u|solve_tril|cumsum|kkt|"
                               r"fwd_kernel_o|fused_gdn", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|reduce|index|cat|copy|fill|"
                               r"where|softmax|silu|sigmoid|gelu|exp|mul|add|triton_", re.I)),
)


def kernel_class(name: str) -> str:
    """The class of a device event by its name (`other` when no rule matches)."""
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "other"


def replay_split(window: Interval, ops: Sequence[DeviceOp],
                 graph_ids: set[int]) -> dict[str, float] | None:
    """One request's device time around its graph replay: the replay's span (first to last
    kernel of the graph's launches), the device's idle time before and after it inside the
    request's window, and the kernels inside and outside the graph; None without a replay."""
    inside = [op for op in ops if window.start_us <= op.start_us < window.end_us]
    graph = [op for op in inside if op.correlation in graph_ids]
    if not graph:
        return None
    start = min(op.start_us for op in graph)
    end = max(op.end_us for op in graph)
    spans = [Interval(op.start_us, op.end_us) for op in inside]
    before = Interval(window.start_us, start)
    after = Interval(end, max(end, window.end_us))
    return {"replay_us": end - start,
            "idle_before_us": (start - window.start_us) - busy_us(spans, before),
            "idle_after_us": (after.end_us - after.start_us) - busy_us(spans, after),
            "kernels_in_graph": float(sum(kernel_class(op.name) != "copy" for op in graph)),
            "kernels_outside_graph": float(sum(kernel_class(op.name) != "copy"
                                               for op in inside if op not in graph))}


def device_summary(ops: Sequence[DeviceOp], windows: Sequence[Interval],
                   graph_ids: set[int]) -> dict[str, Any]:
    """The per-forward figures of the module docs from plain device events (one forward per
    request window): kernels, device ms by class, and the replay split where there is one."""
    requests = max(1, len(windows))
    kernels = [op for op in ops if kernel_class(op.name) != "copy"]
    by_class: dict[str, float] = {}
    for op in ops:
        label = kernel_class(op.name)
        by_class[label] = by_class.get(label, 0.0) + (op.end_us - op.start_us)
    out: dict[str, Any] = {
        "kernels_per_forward": round(len(kernels) / requests, 1),
        "device_ms_by_class": {label: round(us / 1000 / requests, 3)
                               for label, us in sorted(by_class.items(),
                                                       key=lambda item: -item[1])},
    }
    splits = [split for window in windows
              if (split := replay_split(window, ops, graph_ids)) is not None]
    if graph_ids and not splits:
        # Graphs were launched but none of their kernels was traced (a profiler that does not
        # see inside replays): a kernel count without them would pass for a few-kernel forward.
        out["kernels_per_forward"] = None
        out["note"] = "graph launches seen but no kernel of theirs traced: count unknown"
    if splits:
        def mean_ms(key: str) -> float:
            return round(sum(split[key] for split in splits) / len(splits) / 1000, 3)

        out["replay"] = {"requests": len(splits), "replay_ms": mean_ms("replay_us"),
                         "idle_before_ms": mean_ms("idle_before_us"),
                         "idle_after_ms": mean_ms("idle_after_us"),
                         "kernels_in_graph": round(sum(s["kernels_in_graph"] for s in splits)
                                                   / len(splits), 1),
                         "kernels_outside_graph": round(sum(s["kernels_outside_graph"]
                                                            for s in splits) / len(splits), 1)}
    else:
        out["replay"] = None
    return out


def profile_requests(executor: Any, bodies: Sequence[bytes], cuda: bool) -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for body in bodies:
            with record_function(REQUEST_RANGE):
                executor.answer(body)  # ends with a device-to-host copy: synchronised
        if cuda:
            torch.cuda.synchronize()
    return prof


def summarise(prof: Any, requests: int, wall_ms: float, cuda: bool, top: int) -> dict[str, Any]:
    """The numbers of the module docstring, from one profile of `requests` requests."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    windows = [Interval(e.time_range.start, e.time_range.end) for e in events
               if e.name == REQUEST_RANGE and e.device_type == DeviceType.CPU]
    summary: dict[str, Any] = {"requests": requests,
                               "wall_ms_per_request": round(wall_ms / requests, 3)}
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        intervals = [Interval(e.time_range.start, e.time_range.end) for e in kernels]
        summary["device_idle_fraction"] = round(idle_fraction(intervals, windows), 3)
        summary["kernels_per_request"] = round(len(kernels) / requests, 1)
        names = [e.name for e in events if e.device_type == DeviceType.CPU]
        summary["host_kernel_launches_per_request"] = round(
            count_calls(names, KERNEL_LAUNCH_CALLS) / requests, 1)
        summary["graph_launches_per_request"] = round(
            count_calls(names, GRAPH_LAUNCH_CALLS) / requests, 1)
        ops = [DeviceOp(e.name, e.time_range.start, e.time_range.end, e.id) for e in kernels]
        graph_ids = {e.id for e in events
                     if e.device_type == DeviceType.CPU and e.name in GRAPH_LAUNCH_CALLS}
        summary.update(device_summary(ops, windows, graph_ids))
        averages = [a for a in prof.key_averages() if a.device_type == DeviceType.CUDA]
        key = "self_device_time_total"
    else:
        averages = [a for a in prof.key_averages() if a.key != REQUEST_RANGE]
        summary["ops_per_request"] = round(
            sum(a.count for a in averages) / requests, 1)
        key = "self_cpu_time_total"
    ranked = sorted(averages, key=lambda a: getattr(a, key), reverse=True)[:top]
    summary["top"] = [{"name": a.key[:90], "ms_per_request": round(
        getattr(a, key) / 1000 / requests, 3), "calls_per_request": round(a.count / requests, 1)}
        for a in ranked]
    return summary


def markdown(mode: str, summary: dict[str, Any], cuda: bool) -> str:
    lines = [f"**{mode}**: {summary['wall_ms_per_request']} ms per request (wall)"]
    if cuda:
        lines.append(
            f"device idle {summary['device_idle_fraction']:.0%} of it; "
            f"{summary['kernels_per_request']} device operations (kernels and copies) per "
            "request, "
            f"{summary['host_kernel_launches_per_request']} launched one by one from the host, "
            f"{summary['graph_launches_per_request']} graph launches; "
            f"{summary['kernels_per_forward']} kernels per forward")
        lines.append("device ms per forward by class: " + ", ".join(
            f"{label} {ms}" for label, ms in summary["device_ms_by_class"].items()))
        replay = summary.get("replay")
        if replay:
            lines.append(f"replay {replay['replay_ms']} ms ({replay['kernels_in_graph']} "
                         f"kernels in the graph, {replay['kernels_outside_graph']} outside); "
                         f"device idle {replay['idle_before_ms']} ms before it, "
                         f"{replay['idle_after_ms']} ms after it")
    else:
        lines.append(f"{summary['ops_per_request']} torch op calls per request, nested ones "
                     "counted (CPU: no device timeline)")
    what = "kernel" if cuda else "op (self CPU)"
    lines += ["", f"| {what} | ms per request | calls per request |", "|---|---:|---:|"]
    lines += [f"| `{t['name']}` | {t['ms_per_request']} | {t['calls_per_request']} |"
              for t in summary["top"]]
    return "\n".join(lines)


def profile_states(executor: Any, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    """The same figures over requests of `--state-tokens` tokens whose states are distinct and
    at least 256 tokens long (benchlib/gpu_workloads.py): each a fresh forward that stores its
    points in the executor's prefix cache (on, as served), which is what users send."""
    from benchlib.gpu_workloads import DistinctStates

    states = DistinctStates(executor.encoder.tokenizer,
                            lambda request: len(executor.encode(request).input_ids),
                            make_request(executor, 0, 1)["questions"])
    for _ in range(args.warm):
        executor.answer(states.body(args.state_tokens))
    bodies = [states.body(args.state_tokens) for _ in range(args.requests)]
    started = time.perf_counter()
    prof = profile_requests(executor, bodies, cuda)
    wall_ms = (time.perf_counter() - started) * 1000
    return {"tokens": args.state_tokens, "input_tokens": states.encoded_tokens(bodies[0]),
            **summarise(prof, args.requests, wall_ms, cuda, args.top)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    add_mode_arguments(parser, ["graphs"])
    parser.add_argument("--tokens", type=int, default=370)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--state-tokens", type=int, default=400,
                        help="also profile distinct states of this many tokens (0: skip)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    if args.quick:
        apply_quick(args)
        # One request of --tokens per forward: a budget that holds it, so warm-up builds the
        # few shapes up to it, not every one up to the CPU default's 4,096 tokens.
        args.warm, args.requests, args.max_batch_tokens = 1, 2, 1024
    elif args.max_length == 16384:
        args.max_length = 2048  # the profiled request is short: capture only what it needs
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    model = InMemoryModel(args.shape, args.layers)
    results: dict[str, Any] = {"command": command_line(__file__), "modes": {}}
    for mode in args.modes:
        executor = executor_for_mode(model, args, mode)
        executor.warm_up()
        cuda = executor.device.type == "cuda"
        problems = capture_problems(dataclasses.asdict(executor.describe()),
                                    graphs_requested=mode == "graphs", on_cuda=cuda)
        if problems:
            print(json.dumps(results, indent=1))
            print(f"not graphs: {'; '.join(problems)}", file=sys.stderr)
            return 1
        body = json.dumps(make_request(executor, args.tokens, args.questions)).encode()
        for _ in range(args.warm):
            executor.answer(body)
        started = time.perf_counter()
        prof = profile_requests(executor, [body] * args.requests, cuda)
        wall_ms = (time.perf_counter() - started) * 1000
        summary = summarise(prof, args.requests, wall_ms, cuda, args.top)
        results["modes"][mode] = summary
        print(markdown(mode, summary, cuda) + "\n", flush=True)
        if args.state_tokens:
            summary["state"] = profile_states(executor, args, cuda)
            print(markdown(f"{mode}, distinct {args.state_tokens}-token states",
                           summary["state"], cuda) + "\n", flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

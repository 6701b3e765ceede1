"""The start-up self-check: before `ready`, the worker answers a fixed set of requests through
the layout it will serve with and, one by one, through the plain eager forward, and compares.

Why: the serving layouts (packed rows with cumulative offsets, CUDA graphs replaying them, fla's
varlen kernels) are fast paths whose mistakes do not raise. A wrong offset, a keyword a library
renamed or a kernel that reads past a boundary serves wrong probabilities behind a 200 `/health`.
The plain eager forward of one request (`Backbone.last_hidden_state`, no graphs, no packing) is
the path the golden answers are checked against, so it is the reference here; its Triton kernels
are the ones serving compiled, called over one sequence
(clef_worker.starting.self_check_reference), so a
cold check compiles nothing of its own.

The check is a list of probes (clef_worker.starting.check_probes.PROBES), each a function of its own
that sends its requests through the serving path and compares them with the reference
(`Context.compare_groups` does both for a probe that is a set of groups), and returns a
`ProbeResult` (or None where it has nothing to probe on this worker). A new probe is one more
function and one more `Probe` entry; its result travels in the verdict's `probes`. Beside the
layout probes below, the prefix cache has one (clef_worker.starting.prefix_probe), run once after
them, whose remedy turns the cache off rather than the layout. The layout probes:

- `groups` (`probe_groups`): requests of mixed lengths cut from the warm-up's candidate schemas
  (clef_worker.starting.warmup), each with its own state text: a mixed group of four, a uniform
  group of three (CPU's per-group layout runs that one padded), and, where graphs replay fixed
  shapes,
  a few short requests of different lengths (about LARGEST_REAL = 1,000 real tokens, at most
  half the shape) forced into the largest built shape (`largest_shape`, through
  `ModelRunner.run`'s `shape`), padding filling the rest of it. The largest graph is what the
  longest requests replay; forced short requests check it (a request laid at the wrong offset,
  or padding read into the requests, disagrees with their eager answers) while the eager
  reference runs only their real tokens, not the ~16,000 of one near-largest request. The
  probe records the shape (`largest_shape`, `[rows, tokens]` as `graph_shapes` lists it; null
  where no request the schemas make fits it, as no request can then replay it) and
  each group's (`shapes`). Packed, the largest shape is the largest bucket (one row); padded,
  the longest bucket at the most rows built for it (one row of 16,384 at the H200 defaults),
  one short request per row (three at most). Eagerly there is no fixed shape: a forward is
  only as large as its requests, and a lone request takes the plain forward, the reference
  itself.
- `small` (`small_groups`): where 370-token traffic runs. With graphs, a lone ~370-token request
  (the bucket that traffic replays), then two pairs of other lengths in that same bucket one
  after the other (one bucket replayed with different mixes: a graph that replayed the previous
  replay's inputs would answer the second pair with the first one's numbers); and a pair of the
  shortest requests the schema allows (the smallest buckets).

Each group goes through the serve loop's own group cutting
(clef_worker.serving.batching.GroupCutter)
and the runner, as requests do; the largest-shape group alone is one runner call forced into
its shape (the serve loop would replay a smaller one). With fine-tuned variants served, the
requests take the base and each variant in turn (clef_worker.starting.variant_probe).

The comparison (`compare`): every option's probability within the dtype's bound (`BOUNDS`), and
every question's argmax the same unless the reference itself has the two options within the
bound (a tie the bound cannot order). A forward that raises counts as the largest difference a
probability can have, 1. Beside the probabilities each probe records the last hidden state's
per-token relative difference (`max_hidden_diff`: the largest over tokens of |served - eager| /
|eager|, Euclidean norms): a measure of how far the layout is from the reference before the head
hides it. It is recorded, not bounded (only a NaN fails), until a GPU sitting has measured it.

The bf16 bound, 1e-2, is the project's CUDA tests' bound for the same comparison (bf16 served
against a bf16 reference); bf16 against float32 measured 7.1e-3 on an H200. The GPU sitting
(`bench/gpu_session.sh`, `--self-check report`) records the real spread in its summary.

The modes (`run_self_check`): `on` logs an ERROR with the figures on a mismatch and falls back
along `fallback_chain` (packed graphs, packed eager, padded eager, one at a time), re-checking
each; `strict` refuses to start; `report` compares and records but never falls back (the
benchmarks measure the layout they asked for; a disagreement is in the verdict and the log, not
a change of layout); `off` skips the check. The verdict goes into the `ready` frame
(clef_protocol.messages.SelfCheck), so `/health` and the front's metrics show it. A passing
verdict is kept for the next start (clef_worker.starting.verdict_store, in `on` and `strict`).

Cost on a warm GPU, estimated on paper, not measured: at Clef-Flash's shapes a forward costs
about 2 x 7.9e9 = 1.6e10 FLOP per token. The serving path computes every token of the shapes
it replays, padding included; the eager reference only the real tokens. At the H200 defaults
(packed graphs, 16,384-token budget and --max-length, 28 buckets):

- served: the mixed group (125 + 409 + 163 + 245 = 942 real, 1,024 aligned) replays the
  1,024 bucket; the uniform group (3 x 204 = 612 real, 768 aligned) the 768 bucket; the
  largest-shape group (600 + 250 + 150 = 1,000 real, 1,088 aligned) the 16,384 bucket; the
  small probe three 384 buckets and a 256 one (1,408). Total 1,024 + 768 + 16,384 + 1,408
  = 19,584 tokens.
- eager: 942 + 612 + 1,000 + 1,340 (the small probe's 370, 125 + 240, 230 + 125 and the
  shortest pair, 125 + 125) = 3,894 tokens.

(19,584 + 3,894) x 1.6e10 = 3.8e14 FLOP: 0.48 s at the 788 TFLOP/s a bf16 matrix product
measured on an H200, 0.79 s at 60 % of it (473 TFLOP/s). The full-attention layers' quadratic
part adds under 10 % at 16k tokens and the largest bucket's padding is one ~15,300-token dummy
sequence, so at most ~+1,600 token-equivalents: 0.51 s at peak, 0.85 s at 60 %. So under one
second at peak with room, and at 60 % with ~0.15 s to spare. (The lengths above are the probe's
own at those limits, printed from `probe_groups` and `small_groups` on the tiny fixture, whose
524-token vocabulary makes the shortest request 125 tokens; Clef-Flash's tokenizer writes the
schemas in fewer tokens, so its figures are at most these.) The earlier probe, one near-largest
request and groups in 4,096 tokens of room, cost ~41,000 tokens (20,600 each way): 0.84 s at
peak, 1.4 s at 60 %. Without graphs ~2,900 tokens each way: ~0.12 s (0.20 s at 60 %). A restart
on the same weights and code skips the whole check (the kept verdict). The reference compiles
no kernels of its own (it calls the packed serving kernels over one sequence), and the prefix
probe's initial/final-state kernels are compiled by the warm-up (clef_worker.starting.warmup), so a
cold check adds no compilation; `ms` in the verdict and `self_check_ms` in the GPU sitting's summary
record what it really took.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from clef_protocol.messages import SelfCheck
from clef_worker.errors import StartupError
from clef_worker.model.kernel_choice import DTYPE_NAMES

# The check's parts, re-exported: probes and tests reach them through this module.
from clef_worker.starting.self_check_compare import (  # noqa: F401
    Answer,
    Comparison,
    Context,
    ProbeResult,
    compare,
    cut,
    hidden_difference,
)
from clef_worker.starting.self_check_paths import (  # noqa: F401
    ONE_AT_A_TIME,
    ORDER,
    PACKED_EAGER,
    PACKED_GRAPHS,
    PADDED_EAGER,
    PADDED_GRAPHS,
    PER_GROUP_EAGER,
    current_path,
    fallback_chain,
    serving_path,
    switch_to,
)
from clef_worker.starting.self_check_requests import (  # noqa: F401
    GROUP_ROOM,
    LARGEST_MIX,
    LARGEST_REAL,
    MIXED,
    SAME_BUCKET_PAIRS,
    SMALL_LENGTH,
    UNIFORM,
    UNIFORM_COUNT,
    Requests,
    largest_group,
    largest_shape,
    probe_groups,
    probe_plan,
    shape_of,
    small_groups,
)

if TYPE_CHECKING:
    from clef_worker.starting.warm_requests import WarmTarget

log = logging.getLogger("clef_worker.starting.self_check")

# The largest probability difference from the eager one-by-one answer, by the backbone's dtype
# (the head runs in float32 on CPU, in the backbone's dtype on CUDA). bf16: the CUDA tests'
# bound for the same comparison (module docs), until a GPU sitting measures the spread.
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
# The check's own definition: change it whenever a probe, a bound or the comparison changes,
# so a verdict kept by an earlier definition is not reused (clef_worker.starting.verdict_store).
CHECK_VERSION = 5

MODES = ("on", "strict", "report", "off")  # clef_protocol.options.SELF_CHECK_MODES


# -- the probes -------------------------------------------------------------------------------


def probe_layout_groups(context: Context) -> ProbeResult | None:
    """Mixed lengths in one forward, one length in another, and with graphs short requests
    forced into the largest shape, recorded as `largest_shape` (None where no group was
    forced: no graphs, or no request fits that shape), with `shapes` (each group's fixed
    shape) and `lengths`."""
    target = context.target
    plan = probe_plan(target)
    groups = [group for group, _ in plan]
    forced = [None if shape is None else list(shape) for _, shape in plan]
    largest = next((shape for shape in forced if shape is not None), None)
    # Each group's fixed shape as `shape_of` writes it ([tokens] packed, [[rows, tokens]]
    # padded), the forced one included.
    shapes = [shape_of(target, [e.length for e in group]) if shape is None
              else [shape[1]] if target.runner.packed else [shape]
              for shape, group in zip(forced, groups, strict=True)]
    return context.compare_groups("groups", groups, forced=forced, extra={
        "lengths": [[encoding.length for encoding in group] for group in groups],
        "shapes": shapes,
        "largest_shape": largest})


def probe_small(context: Context) -> ProbeResult | None:
    """The small buckets: the 370-token shape replayed with three mixes, the shortest pair."""
    groups = small_groups(context.target)
    shapes = [shape_of(context.target, [encoding.length for encoding in group])
              for group in groups]
    replayed = [shape for shape in shapes if shape is not None]
    return context.compare_groups("small", groups, extra={
        "lengths": [[encoding.length for encoding in group] for group in groups],
        "shapes": shapes,
        # The same fixed shape run with different mixes, back to back (graphs only).
        "replayed_same_shape": len(replayed) >= 2 and replayed[0] == replayed[1]})


ProbeFunction = Callable[[Context], "ProbeResult | None"]


@dataclass(frozen=True)
class Probe:
    """One probe of the check. `layout`: a disagreement means the serving layout is wrong,
    so `on` falls back along the chain and runs every layout probe again. Otherwise the probe
    checks something beside the layout (a cache, a variant) and runs once, after the layout
    probes; on a disagreement `on` calls its `remedy` (turn that thing off; returns what it
    did, for the log and the verdict), or, without one, the verdict fails."""

    name: str
    run: ProbeFunction
    layout: bool = True
    remedy: Callable[[WarmTarget, ProbeResult], str] | None = None


# The layout probes, in the order run. The whole check's list, these and the probes of other
# things (the prefix cache's), is clef_worker.starting.check_probes.PROBES.
LAYOUT_PROBES: tuple[Probe, ...] = (
    Probe("groups", probe_layout_groups),
    Probe("small", probe_small),
)


# -- the whole check ----------------------------------------------------------------------


def bound_for(target: WarmTarget) -> float:
    """The probability bound for the executor's dtype."""
    return BOUNDS.get(DTYPE_NAMES[target.backbone.dtype], BOUNDS["bfloat16"])


def _run_probes(context: Context, probes: Sequence[Probe]) -> list[ProbeResult]:
    results = []
    for probe in probes:
        result = probe.run(context)
        if result is not None:
            results.append(result)
    return results


def run_self_check(target: WarmTarget, mode: str, probes: Sequence[Probe]) -> SelfCheck | None:
    """Check the serving path (module docs); None when skipped (`off`, or no request fits the
    limits). `strict`: StartupError on a mismatch. `on`: fall back until a path agrees.
    `report`: record, never change the path."""
    if mode == "off":
        log.info("self-check off: the serving path is not compared with the eager answers")
        return None
    if mode not in MODES:
        raise ValueError(f"unknown self-check mode {mode!r}: expected one of {MODES}")
    started = time.perf_counter()
    dtype = DTYPE_NAMES[target.backbone.dtype]
    bound = bound_for(target)
    context = Context(target, bound)
    layout_probes = [probe for probe in probes if probe.layout]
    start = current_path(target)
    failed: list[str] = []
    agreed = False
    results: list[ProbeResult] = []
    path = start
    for path in [start, *([] if mode == "report" else fallback_chain(start))]:
        if failed:
            switch_to(target, path, f"self-check: {failed[0]} disagreed with the eager answers")
        results = _run_probes(context, layout_probes)
        if not results:
            log.warning("self-check skipped: no request fits the request limits")
            return None
        disagreeing = [result for result in results if not result.agrees(bound)]
        if not disagreeing:
            agreed = True
            break
        _log_mismatch(path, disagreeing, bound, dtype, mode)
        if mode == "strict":
            worst = max(disagreeing, key=lambda result: result.max_abs_diff)
            raise StartupError(
                f"self-check failed (--self-check strict): the {path} path differs from the "
                f"eager one-by-one answers by {worst.max_abs_diff:.3g} (bound {bound:g}) in "
                f"the {worst.name} probe, {worst.argmax_mismatches} argmax mismatches"
                f"{', ' + worst.error if worst.error else ''}")
        failed.append(path)
    if not agreed and mode != "report":
        log.error("self-check: no path agrees with the eager answers; serving %s anyway", path)
    fell_back = failed if agreed else failed[:-1]
    layout_results = list(results)
    others = _run_others(context, [probe for probe in probes if not probe.layout], mode,
                         bound)
    results = [*layout_results, *others]
    passed = agreed and all(result.agrees(bound) or "remedy" in result.extra
                            for result in others)
    verdict = SelfCheck(
        passed, path, sum(result.checked for result in results),
        max(result.max_abs_diff for result in layout_results), fell_back, mode=mode,
        bound=bound, max_hidden_diff=_largest_hidden(results),
        ms=round((time.perf_counter() - started) * 1000.0, 1),
        probes=[result.record(bound) for result in results])
    _log_verdict(verdict, results)
    return verdict


def _run_others(context: Context, probes: Sequence[Probe], mode: str,
                bound: float) -> list[ProbeResult]:
    """The probes of something beside the layout, once; `on` applies a disagreeing one's
    remedy, `strict` refuses to start."""
    results = []
    for probe in probes:
        result = probe.run(context)
        if result is None:
            continue
        if not result.agrees(bound):
            _log_mismatch(current_path(context.target), [result], bound,
                          DTYPE_NAMES[context.target.backbone.dtype], mode)
            if mode == "strict":
                raise StartupError(
                    f"self-check failed (--self-check strict): the {probe.name} probe differs "
                    f"from the eager one-by-one answers by {result.max_abs_diff:.3g} "
                    f"(bound {bound:g})")
            if mode == "on" and probe.remedy is not None:
                done = probe.remedy(context.target, result)
                log.error("self-check: %s", done)
                result = dataclasses.replace(result, extra={**result.extra, "remedy": done})
        results.append(result)
    return results


def _largest_hidden(results: Sequence[ProbeResult]) -> float:
    values = [result.max_hidden_diff for result in results]
    finite = [value for value in values if not math.isnan(value)]
    return max(finite, default=0.0)


def _log_mismatch(path: str, results: Sequence[ProbeResult], bound: float, dtype: str,
                  mode: str) -> None:
    """One ERROR for a path that disagreed, with each disagreeing probe's figures."""
    chain = [] if mode == "report" else fallback_chain(path)
    figures = "; ".join(
        f"{result.name} probe: max |dp| {result.max_abs_diff:.3g}, {result.argmax_mismatches} "
        f"argmax mismatches, per forward {[float(f'{diff:.3g}') for diff in result.groups]}, "
        f"largest at {result.worst_tokens} tokens, hidden-state difference "
        f"{result.max_hidden_diff:.3g}, over {result.checked} requests"
        f"{', error ' + result.error if result.error else ''}" for result in results)
    log.error(
        "self-check: the %s path differs from the eager one-by-one answers (bound %g for %s): "
        "%s; %s", path, bound, dtype, figures,
        "recorded, not falling back (--self-check report)" if mode == "report" else
        f"falling back to {chain[0]}" if chain else "nothing slower to fall back to")


def _log_verdict(verdict: SelfCheck, results: Sequence[ProbeResult]) -> None:
    lengths = {result.name: result.checked for result in results}
    if verdict.fell_back_from:
        log.warning("self-check: serving %s (fell back from %s); max |dp| %.3g within %g, "
                    "hidden-state difference %.3g, requests by probe %s, in %.0f ms",
                    verdict.layout, ", ".join(verdict.fell_back_from), verdict.max_abs_diff,
                    verdict.bound, verdict.max_hidden_diff, lengths, verdict.ms)
    elif verdict.passed:
        log.info("self-check passed on %s: max |dp| %.3g within %g, hidden-state difference "
                 "%.3g, requests by probe %s, in %.0f ms", verdict.layout,
                 verdict.max_abs_diff, verdict.bound, verdict.max_hidden_diff, lengths,
                 verdict.ms)
    else:
        log.error("self-check failed on %s (--self-check %s): max |dp| %.3g, bound %g, "
                  "hidden-state difference %.3g, requests by probe %s, in %.0f ms",
                  verdict.layout, verdict.mode, verdict.max_abs_diff, verdict.bound,
                  verdict.max_hidden_diff, lengths, verdict.ms)

"""The start-up self-check: before `ready`, the worker answers a fixed set of requests through
the layout it will serve with and, one by one, through the plain eager forward, and compares.

Why: the serving layouts (packed rows with cumulative offsets, CUDA graphs replaying them, fla's
varlen kernels) are fast paths whose mistakes do not raise. A wrong offset, a keyword a library
renamed or a kernel that reads past a boundary serves wrong probabilities behind a 200 `/health`.
The plain eager forward of one request (`Backbone.last_hidden_state`, no graphs, no packing) is
the path the golden answers are checked against, so it is the reference here.

The probe (`probe_groups`): requests of mixed lengths cut from the warm-up's candidate schemas
(clef_worker.warmup), each with its own state text: a mixed group of four, a uniform group of
three (CPU's per-group layout runs that one padded), and, where graphs replay fixed shapes,
one request near the largest bucket (eagerly a lone request takes the plain forward, which is
the reference itself, so a long one would only double the check's time). Each
group goes through the serve loop's own group cutting (clef_worker.batching.GroupCutter) and the
runner, as requests do. With fine-tuned variants served, the requests take the base and each
variant in turn (clef_worker.variant_probe).

The comparison (`compare`): every option's probability within the dtype's bound (`BOUNDS`), and
every question's argmax the same unless the reference itself has the two options within the
bound (a tie the bound cannot order). A forward that raises counts as the largest difference a
probability can have, 1.

On a mismatch (`run_self_check`): `on` logs an ERROR with the figures and falls back along
`fallback_chain` (packed graphs, packed eager, padded eager, one at a time), re-checking each;
`strict` refuses to start; `off` skips the check. The verdict goes into the `ready` frame
(clef_protocol.messages.SelfCheck), so `/health` and the front's metrics show it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clef_protocol.errors import RequestInvalid
from clef_protocol.messages import SelfCheck
from clef_protocol.validation import validate_request
from clef_worker.batching import GroupCutter
from clef_worker.errors import StartupError
from clef_worker.model.backbone import DTYPE_NAMES
from clef_worker.model.encoding import Encoding
from clef_worker.policy import PACKED, PADDED, PER_GROUP
from clef_worker.runner import RowResult
from clef_worker.variant_probe import probe_slots, reference_runner
from clef_worker.warmup import candidates

if TYPE_CHECKING:
    from clef_worker.warmup import WarmTarget

log = logging.getLogger("clef_worker.self_check")

# The largest probability difference from the eager one-by-one answer, by the backbone's dtype
# (the head runs in float32 on CPU, in the backbone's dtype on CUDA).
BOUNDS = {"float32": 1e-4, "bfloat16": 2e-3, "float16": 2e-3}

# The paths a worker can serve with, fastest first. `-graphs`: the runner replays fixed shapes
# (captured CUDA graphs; on CPU with `--cuda-graphs on`, the same shapes run eagerly).
PACKED_GRAPHS = "packed-graphs"
PACKED_EAGER = PACKED
PER_GROUP_EAGER = PER_GROUP
PADDED_GRAPHS = "padded-graphs"
PADDED_EAGER = PADDED
ONE_AT_A_TIME = "one-at-a-time"
ORDER = (PACKED_GRAPHS, PACKED_EAGER, PER_GROUP_EAGER, PADDED_GRAPHS, PADDED_EAGER, ONE_AT_A_TIME)

# Fractions of the token room (the budget, or --max-length if smaller) of the mixed group's
# requests, and of each of the uniform group's three: together within the budget, so each
# group is one forward where the budget allows it.
# Small shares: the check runs every request twice at start-up.
MIXED = (0.03, 0.2, 0.08, 0.12)
UNIFORM = 0.1
UNIFORM_COUNT = 3
# How far below the largest length the last request stays (inside the largest bucket once a
# packed graph aligns it to 64).
NEAR_LARGEST = 32


def serving_path(layout: str, graphs: bool, max_sequences: int) -> str:
    """The name of the path a runner with this layout, graphs or not, and requests per forward
    serves with (one of ORDER)."""
    if graphs:
        return f"{layout}-graphs"
    if max_sequences == 1:
        return ONE_AT_A_TIME
    return layout


def fallback_chain(start: str) -> list[str]:
    """The paths tried after `start` disagrees, in order: the slower ones of ORDER that need
    nothing built at start-up (no graph is captured after warm-up) and mix no layouts (after a
    packed path disagreed, per-group would still pack its mixed groups)."""
    if start not in ORDER:
        raise ValueError(f"unknown serving path {start!r}: expected one of {', '.join(ORDER)}")
    later = ORDER[ORDER.index(start) + 1:]
    return [path for path in later if path not in (PADDED_GRAPHS, PER_GROUP_EAGER)]


def current_path(target: WarmTarget) -> str:
    """The path the executor serves with now."""
    runner = target.runner
    return serving_path(runner.layout, runner.graphs is not None, target.policy.max_sequences)


def switch_to(target: WarmTarget, path: str, reason: str) -> None:
    """Make the executor serve with `path`, one of `fallback_chain`'s (eager: graphs are
    dropped, and `ready` then lists the planned shapes with none captured, as after a failed
    capture; `reason` says why)."""
    if path not in (PACKED_EAGER, PADDED_EAGER, ONE_AT_A_TIME):
        raise ValueError(f"cannot fall back to {path!r}: nothing is built after warm-up")
    runner = target.runner
    if runner.graphs is not None:
        target.planned_shapes = runner.graphs.planned_shapes()
        target.graph_failure = reason
        runner.graphs = None
    layout = PACKED if path == PACKED_EAGER else PADDED
    runner.layout = layout
    sequences = 1 if path == ONE_AT_A_TIME else target.policy.max_sequences
    target.policy = dataclasses.replace(target.policy, layout=layout, max_sequences=sequences)


# -- the probe --------------------------------------------------------------------------------


def largest_length(target: WarmTarget) -> int:
    """The longest request the largest graph bucket holds (the token budget without graphs),
    never above --max-length."""
    graphs = target.runner.graphs
    buckets = graphs.describe().get("buckets") if graphs is not None else None
    largest = max(buckets) if buckets else target.policy.max_batch_tokens
    return min(largest, target.limits.max_length)


def probe_groups(target: WarmTarget) -> list[list[Encoding]]:
    """The fixed requests, as the groups they are sent in (mixed, uniform, near the largest);
    empty when no request fits the limits."""
    schemas = [request for request in candidates(target.limits) if _fits(target, request)]
    if not schemas:
        return []
    rich, bare = schemas[0], schemas[-1]
    floor = {id(rich): _fixed_length(target, rich), id(bare): _fixed_length(target, bare)}
    room = min(target.policy.max_batch_tokens, target.limits.max_length)
    counter = iter(range(1_000))

    def make(tokens: int, prefer_rich: bool) -> Encoding:
        schema = rich if prefer_rich and tokens > floor[id(rich)] else bare
        tokens = min(max(tokens, floor[id(schema)] + 1), target.limits.max_length)
        return _encoding(target, schema, next(counter), tokens)

    mixed = [make(int(room * share), prefer_rich=i % 2 == 1) for i, share in enumerate(MIXED)]
    # One schema, one length: the encoder cuts each long state to exactly the same count.
    uniform = [make(int(room * UNIFORM), prefer_rich=False) for _ in range(UNIFORM_COUNT)]
    if target.runner.graphs is None:
        # Eagerly a request alone runs the plain forward, the reference itself: a long one
        # would only double the check's time.
        return [mixed, uniform]
    return [mixed, uniform, [make(largest_length(target) - NEAR_LARGEST, prefer_rich=True)]]


def _fits(target: WarmTarget, request: dict[str, Any]) -> bool:
    try:
        validate_request(request, target.limits)
        target.encode(request)
    except RequestInvalid:
        return False
    return True


def _fixed_length(target: WarmTarget, schema: dict[str, Any]) -> int:
    """The schema's tokens with a one-word state."""
    return target.encoder.encode({**schema, "state": "x"}, target.limits.max_length).length


def _encoding(target: WarmTarget, schema: dict[str, Any], number: int, tokens: int) -> Encoding:
    """Request `number` of the probe: the schema with a state of its own, cut to `tokens`."""
    sentences = tokens // 4 + 8  # every sentence is several tokens: more than enough to cut
    state = "".join(f"Probe {number}-{k}: invoice #{number * 97 + k} was paid twice. "
                    for k in range(sentences))
    return target.encoder.encode({**schema, "state": state}, tokens)


# -- answering and comparing --------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """How the served answers differ from the reference: the largest probability difference
    (1 where a forward raised), the questions whose argmax differs beyond a tie, the request
    with the largest difference and its token count, and the exception, if one was raised."""

    max_abs_diff: float
    argmax_mismatches: int
    worst: int = -1
    worst_tokens: int = 0
    error: str = ""

    def agrees(self, bound: float) -> bool:
        return not self.error and self.max_abs_diff <= bound and self.argmax_mismatches == 0


def answer_served(target: WarmTarget, groups: Sequence[Sequence[Encoding]]) -> list[RowResult]:
    """Every probe request through the serving path: each group cut as the serve loop cuts
    requests (the token budget, the requests per forward), each cut group one runner call."""
    rows: list[RowResult] = []
    slots = iter(probe_slots(target.runner, sum(len(group) for group in groups)))
    for group in groups:
        group_slots = [next(slots) for _ in group]
        for members in cut(target, [encoding.length for encoding in group]):
            rows += target.runner.run([group[member] for member in members], (),
                                      [group_slots[member] for member in members]).rows
    return rows


def cut(target: WarmTarget, lengths: Sequence[int]) -> list[list[int]]:
    """The forwards the serve loop would cut requests of these lengths into (the same
    `GroupCutter`, the executor's cost and policy), as positions."""
    policy = target.policy
    cutter = GroupCutter(target.runner.batch_tokens, policy.max_batch_tokens,
                         policy.max_sequences)
    groups = [closed for position, length in enumerate(lengths)
              if (closed := cutter.add(position, length))]
    last = cutter.finish()
    return [*groups, last] if last else groups


def answer_reference(target: WarmTarget, encodings: Sequence[Encoding]) -> list[RowResult]:
    """Every probe request alone through the plain eager forward (no graphs, no packing)."""
    slots = probe_slots(target.runner, len(encodings))
    with reference_runner(target.runner) as plain:
        return [plain.run([encoding], (), [slot]).rows[0]
                for encoding, slot in zip(encodings, slots, strict=True)]


def compare(served: Sequence[RowResult], reference: Sequence[RowResult],
            encodings: Sequence[Encoding], bound: float) -> Comparison:
    """The served answers against the reference, request by request, question by question."""
    largest, mismatches, worst = 0.0, 0, -1
    for position, (got, want, encoding) in enumerate(
            zip(served, reference, encodings, strict=True)):
        diffs = [abs(a - b) for a, b in zip(got.probabilities, want.probabilities, strict=True)]
        diff = max((1.0 if math.isnan(d) else d for d in diffs), default=0.0)
        if worst < 0 or diff > largest:
            largest, worst = diff, position
        start = 0
        for question in encoding.questions:
            count = len(question.option_ids)
            mismatches += _argmax_differs(got.probabilities[start:start + count],
                                          want.probabilities[start:start + count], bound)
            start += count
    tokens = encodings[worst].length if worst >= 0 else 0
    return Comparison(min(largest, 1.0), mismatches, worst, tokens)


def _argmax_differs(got: Sequence[float], want: Sequence[float], bound: float) -> bool:
    """Whether the served argmax is not the reference's, unless the reference has them tied
    within the bound."""
    if not want:
        return False
    served = max(range(len(got)), key=got.__getitem__)
    best = max(range(len(want)), key=want.__getitem__)
    return served != best and not want[best] - want[served] <= bound


def check(target: WarmTarget, groups: Sequence[Sequence[Encoding]],
          reference: Sequence[RowResult], bound: float) -> Comparison:
    """The serving path's answers to the probe against the reference."""
    encodings = [encoding for group in groups for encoding in group]
    try:
        served = answer_served(target, groups)
    except Exception as exc:
        log.error("self-check: the %s path raised on the probe requests", current_path(target),
                  exc_info=True)
        return Comparison(1.0, 0, error=f"{type(exc).__name__}: {exc}")
    return compare(served, reference, encodings, bound)


# -- the whole check ----------------------------------------------------------------------


def run_self_check(target: WarmTarget, mode: str) -> SelfCheck | None:
    """Check the serving path (module docs); None when skipped (`off`, or no request fits the
    limits). `strict`: StartupError on a mismatch. `on`: fall back until a path agrees."""
    if mode == "off":
        log.info("self-check off: the serving path is not compared with the eager answers")
        return None
    started = time.perf_counter()
    groups = probe_groups(target)
    if not groups:
        log.warning("self-check skipped: no request fits the request limits")
        return None
    encodings = [encoding for group in groups for encoding in group]
    dtype = DTYPE_NAMES[target.backbone.dtype]
    bound = BOUNDS.get(dtype, BOUNDS["bfloat16"])
    reference = answer_reference(target, encodings)
    start = current_path(target)
    failed: list[str] = []
    for path in [start, *fallback_chain(start)]:
        if failed:
            switch_to(target, path, f"self-check: {failed[0]} disagreed with the eager answers")
        comparison = check(target, groups, reference, bound)
        if comparison.agrees(bound):
            verdict = SelfCheck(True, path, len(encodings), comparison.max_abs_diff, failed)
            _log_verdict(verdict, bound, [e.length for e in encodings], started)
            return verdict
        _log_mismatch(path, comparison, bound, len(encodings), dtype)
        if mode == "strict":
            raise StartupError(
                f"self-check failed (--self-check strict): the {path} path differs from the "
                f"eager one-by-one answers by {comparison.max_abs_diff:.3g} (bound {bound:g}), "
                f"{comparison.argmax_mismatches} argmax mismatches"
                f"{', ' + comparison.error if comparison.error else ''}")
        failed.append(path)
    log.error("self-check: no path agrees with the eager answers; serving %s anyway", path)
    return SelfCheck(False, path, len(encodings), comparison.max_abs_diff, failed[:-1])


def _log_mismatch(path: str, comparison: Comparison, bound: float, checked: int,
                  dtype: str) -> None:
    chain = fallback_chain(path)
    log.error(
        "self-check: the %s path differs from the eager one-by-one answers: max |dp| %.3g "
        "(bound %g for %s) at probe request %d (%d tokens), %d argmax mismatches, over %d "
        "requests%s; %s", path, comparison.max_abs_diff, bound, dtype, comparison.worst,
        comparison.worst_tokens, comparison.argmax_mismatches, checked,
        f", error {comparison.error}" if comparison.error else "",
        f"falling back to {chain[0]}" if chain else "nothing slower to fall back to")


def _log_verdict(verdict: SelfCheck, bound: float, lengths: list[int], started: float) -> None:
    took = (time.perf_counter() - started) * 1000
    if verdict.fell_back_from:
        log.warning("self-check: serving %s (fell back from %s); max |dp| %.3g within %g over "
                    "%d requests of %s tokens, in %.0f ms", verdict.layout,
                    ", ".join(verdict.fell_back_from), verdict.max_abs_diff, bound,
                    verdict.checked, lengths, took)
    else:
        log.info("self-check passed on %s: max |dp| %.3g within %g over %d requests of %s "
                 "tokens, in %.0f ms", verdict.layout, verdict.max_abs_diff, bound,
                 verdict.checked, lengths, took)

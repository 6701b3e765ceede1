"""The start-up self-check: before `ready`, the worker answers a fixed set of requests through
the layout it will serve with and, one by one, through the plain eager forward, and compares.

Why: the serving layouts (packed rows with cumulative offsets, CUDA graphs replaying them, fla's
varlen kernels) are fast paths whose mistakes do not raise. A wrong offset, a keyword a library
renamed or a kernel that reads past a boundary serves wrong probabilities behind a 200 `/health`.
The plain eager forward of one request (`Backbone.last_hidden_state`, no graphs, no packing) is
the path the golden answers are checked against, so it is the reference here.

The check is a list of probes (clef_worker.check_probes.PROBES), each a function of its own
that sends its requests through the serving path and compares them with the reference
(`Context.compare_groups` does both for a probe that is a set of groups), and returns a
`ProbeResult` (or None where it has nothing to probe on this worker). A new probe is one more
function and one more `Probe` entry; its result travels in the verdict's `probes`. Beside the
layout probes below, the prefix cache has one (clef_worker.prefix_check), run once after them,
whose remedy turns the cache off rather than the layout. The layout probes:

- `groups` (`probe_groups`): requests of mixed lengths cut from the warm-up's candidate schemas
  (clef_worker.warmup), each with its own state text: a mixed group of four, a uniform group of
  three (CPU's per-group layout runs that one padded), and, where graphs replay fixed shapes,
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

Each group goes through the serve loop's own group cutting (clef_worker.batching.GroupCutter)
and the runner, as requests do; the largest-shape group alone is one runner call forced into
its shape (the serve loop would replay a smaller one). With fine-tuned variants served, the
requests take the base and each variant in turn (clef_worker.variant_probe).

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
verdict is kept for the next start (clef_worker.verdict_store, in `on` and `strict`).

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
on the same weights and code skips the whole check (the kept verdict). A cold start adds the
compilation of the eager reference's fixed-length kernels (a graph warm-up never uses them);
`ms` in the verdict and `self_check_ms` in the GPU sitting's summary record what it really took.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from clef_protocol.errors import RequestInvalid
from clef_protocol.messages import SelfCheck
from clef_protocol.validation import validate_request
from clef_worker.batching import GroupCutter
from clef_worker.errors import StartupError
from clef_worker.gpu.packed_graphs import PackedGraphRunner, aligned_total
from clef_worker.model.encoding import Encoding
from clef_worker.model.kernel_choice import DTYPE_NAMES
from clef_worker.policy import PACKED, PADDED, PER_GROUP
from clef_worker.runner import RowResult
from clef_worker.variant_probe import probe_slots, reference_runner

if TYPE_CHECKING:
    from clef_worker.warmup import WarmTarget

log = logging.getLogger("clef_worker.self_check")

# The largest probability difference from the eager one-by-one answer, by the backbone's dtype
# (the head runs in float32 on CPU, in the backbone's dtype on CUDA). bf16: the CUDA tests'
# bound for the same comparison (module docs), until a GPU sitting measures the spread.
BOUNDS = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
# The check's own definition: change it whenever a probe, a bound or the comparison changes,
# so a verdict kept by an earlier definition is not reused (clef_worker.verdict_store).
CHECK_VERSION = 4

MODES = ("on", "strict", "report", "off")  # clef_protocol.options.SELF_CHECK_MODES

# The paths a worker can serve with, fastest first. `-graphs`: the runner replays fixed shapes
# (captured CUDA graphs; on CPU with `--cuda-graphs on`, the same shapes run eagerly).
PACKED_GRAPHS = "packed-graphs"
PACKED_EAGER = PACKED
PER_GROUP_EAGER = PER_GROUP
PADDED_GRAPHS = "padded-graphs"
PADDED_EAGER = PADDED
ONE_AT_A_TIME = "one-at-a-time"
ORDER = (PACKED_GRAPHS, PACKED_EAGER, PER_GROUP_EAGER, PADDED_GRAPHS, PADDED_EAGER, ONE_AT_A_TIME)

# Fractions of the token room (`GROUP_ROOM`, the budget or --max-length if smaller) of the
# mixed group's requests, and of each of the uniform group's three: together within the
# budget, so each group is one forward where the budget allows it.
# Small shares: the check runs every request twice at start-up.
MIXED = (0.03, 0.2, 0.08, 0.12)
UNIFORM = 0.1
UNIFORM_COUNT = 3
# The mixed and uniform groups test mixing, not size (the largest-shape group tests size):
# their room is capped, so a 16,384-token budget does not make them ~12,000 tokens each way
# (at 2,048, mixed lengths of 125 to 409 tokens and uniform ones of 204: the cost estimate).
GROUP_ROOM = 2048
# The largest-shape group (graphs only): short requests of these shares of LARGEST_REAL real
# tokens (at most half the shape's tokens, so padding always follows them), forced into the
# largest built shape. Only their real tokens go through the eager reference.
LARGEST_REAL = 1000
LARGEST_MIX = (0.6, 0.25, 0.15)
# The small probe: the length most traffic has, and two pairs in the same bucket as it (each
# pair's requests aligned to 64 add up to 384, the bucket a lone 370-token request uses).
SMALL_LENGTH = 370
SAME_BUCKET_PAIRS = ((120, 240), (230, 110))


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


# -- the probes' requests ---------------------------------------------------------------------


def largest_shape(target: WarmTarget) -> tuple[int, int] | None:
    """The largest built graph shape, `[rows, tokens]` as `graph_shapes` lists it: packed,
    the largest bucket (one row); padded, the longest bucket at the most rows built for it
    (at the H200 defaults one row of 16,384 tokens, the shape the longest requests replay).
    None without graphs or before warm-up has built any."""
    graphs = target.runner.graphs
    if graphs is None or not graphs.static:
        return None
    if isinstance(graphs, PackedGraphRunner):
        return (1, max(graphs.static))
    rows, tokens = max(graphs.static, key=lambda shape: (shape[1], shape[0]))
    return (rows, tokens)


class Requests:
    """Probe requests of chosen lengths, each with a state of its own: the richest schema the
    limits take where the length allows it, else the barest."""

    def __init__(self, target: WarmTarget) -> None:
        from clef_worker.warmup import candidates

        self.target = target
        self.schemas = [request for request in candidates(target.limits)
                        if _fits(target, request)]
        self.floor = {id(schema): _fixed_length(target, schema) for schema in self.schemas}
        self._numbers = iter(range(1_000_000))

    @property
    def shortest(self) -> int:
        """The shortest request the barest schema makes (a one-token state)."""
        return self.floor[id(self.schemas[-1])] + 1

    def make(self, tokens: int, prefer_rich: bool = False) -> Encoding:
        rich, bare = self.schemas[0], self.schemas[-1]
        schema = rich if prefer_rich and tokens > self.floor[id(rich)] else bare
        tokens = min(max(tokens, self.floor[id(schema)] + 1), self.target.limits.max_length)
        return _encoding(self.target, schema, next(self._numbers), tokens)


def probe_groups(target: WarmTarget) -> list[list[Encoding]]:
    """The `groups` probe's requests, as the groups they are sent in (mixed, uniform, and with
    graphs the `largest_group`, last); empty when no request fits the limits."""
    return [group for group, _ in probe_plan(target)]


def probe_plan(target: WarmTarget) -> list[tuple[list[Encoding], tuple[int, int] | None]]:
    """`probe_groups`' groups, each with the graph shape it is forced into (None: cut and
    run as the serve loop would)."""
    requests = Requests(target)
    if not requests.schemas:
        return []
    room = min(target.policy.max_batch_tokens, target.limits.max_length, GROUP_ROOM)
    mixed = [requests.make(int(room * share), prefer_rich=i % 2 == 1)
             for i, share in enumerate(MIXED)]
    # One schema, one length: the encoder cuts each long state to exactly the same count.
    uniform = [requests.make(int(room * UNIFORM)) for _ in range(UNIFORM_COUNT)]
    plan: list[tuple[list[Encoding], tuple[int, int] | None]] = [(mixed, None), (uniform, None)]
    # Eagerly there is no fixed shape to fill: a forward is only as large as its requests.
    largest = largest_group(target, requests)
    if largest is not None:
        plan.append((largest, largest_shape(target)))
    return plan


def largest_group(target: WarmTarget, requests: Requests) -> list[Encoding] | None:
    """The requests forced into `largest_shape`: shares of LARGEST_REAL tokens (LARGEST_MIX),
    at most half the shape's tokens and one per row (padded) or `max_sequences` (packed),
    the last ones dropped until they fit the shape. None without graphs, or where even the
    shortest request the schemas make does not fit the largest shape (no request can then
    replay it: every longer one runs eagerly).

    Why short requests and not one near the largest length: served, the shape costs its full
    tokens however few are real, but the eager reference runs only the real ones, so the
    largest graph is checked for about 1,000 reference tokens instead of 16,000. A graph
    that reads its padding into the requests, or lays them at the wrong offsets, disagrees
    with their eager answers all the same."""
    shape = largest_shape(target)
    if shape is None:
        return None
    rows, tokens = shape
    graphs = target.runner.graphs
    count = rows if not isinstance(graphs, PackedGraphRunner) else graphs.max_sequences
    total = min(LARGEST_REAL, tokens // 2)
    group = [requests.make(max(int(total * share), requests.shortest), prefer_rich=i % 2 == 0)
             for i, share in enumerate(LARGEST_MIX[:max(count, 1)])]

    def fits(encodings: list[Encoding]) -> bool:
        lengths = [encoding.length for encoding in encodings]
        return (aligned_total(lengths) if isinstance(graphs, PackedGraphRunner)
                else max(lengths)) <= tokens

    while len(group) > 1 and not fits(group):
        group.pop()
    return group if fits(group) else None


def small_groups(target: WarmTarget) -> list[list[Encoding]]:
    """The `small` probe's requests (module docs): with graphs a lone `SMALL_LENGTH` request
    first; then the pairs of `SAME_BUCKET_PAIRS`, one after the other; then a pair of the
    shortest requests. Empty when no request fits the limits."""
    requests = Requests(target)
    if not requests.schemas:
        return []
    lone = [[requests.make(SMALL_LENGTH)]] if target.runner.graphs is not None else []
    pairs = [[requests.make(first), requests.make(second)]
             for first, second in SAME_BUCKET_PAIRS]
    shortest = [requests.make(requests.shortest), requests.make(requests.shortest)]
    return [*lone, *pairs, shortest]


def shape_of(target: WarmTarget, lengths: Sequence[int]) -> list[Any] | None:
    """The fixed shape a group of these lengths replays ([total tokens] of a packed bucket, or
    each padded forward's [rows, tokens]); None where it runs eagerly."""
    runner = target.runner
    graphs = runner.graphs
    if graphs is None:
        return None
    bucket_for = getattr(graphs, "bucket_for", None)
    if bucket_for is not None:
        bucket = bucket_for(lengths)
        return None if bucket is None else [bucket]
    shapes = [list(step.shape) for step in runner.plan(lengths) if step.shape is not None]
    return shapes or None


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


# The first word of each probe request's state: distinct initials, so even requests cut to a
# one-token state (the shortest pair) differ from each other.
FIRST_WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel",
               "India", "Juliett", "Kilo", "Lima", "Mike", "November", "Oscar", "Papa",
               "Quebec", "Romeo", "Sierra", "Tango", "Uniform", "Victor", "Whiskey", "Xray",
               "Yankee", "Zulu")


def _encoding(target: WarmTarget, schema: dict[str, Any], number: int, tokens: int) -> Encoding:
    """Request `number` of the probe: the schema with a state of its own, cut to `tokens`."""
    sentences = tokens // 4 + 8  # every sentence is several tokens: more than enough to cut
    state = FIRST_WORDS[number % len(FIRST_WORDS)] + " " + "".join(
        f"Probe {number}-{k}: invoice #{number * 97 + k} was paid twice. "
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


def hidden_difference(served: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest per-token relative difference of two [tokens, H] hidden states (Euclidean
    norms, in float32); NaN when either holds one."""
    if served.shape != reference.shape:
        return math.nan
    served, reference = served.float(), reference.float()
    scale = torch.linalg.vector_norm(reference, dim=-1).clamp_min(1e-6)
    relative = torch.linalg.vector_norm(served - reference, dim=-1) / scale
    if relative.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(relative).all()):
        return math.nan
    return float(relative.max())


@dataclass(frozen=True)
class ProbeResult:
    """One probe's comparison: requests compared, the largest probability difference (1 where
    a forward raised), argmax mismatches beyond a tie, the largest per-token hidden-state
    difference (NaN: a non-finite hidden state), the largest difference per forward, the error
    of a forward that raised, and whatever else the probe records (`extra`)."""

    name: str
    checked: int
    max_abs_diff: float
    argmax_mismatches: int = 0
    max_hidden_diff: float = 0.0
    groups: list[float] = field(default_factory=list)
    error: str = ""
    worst_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def agrees(self, bound: float) -> bool:
        return (not self.error and self.max_abs_diff <= bound and self.argmax_mismatches == 0
                and not math.isnan(self.max_hidden_diff))

    def record(self, bound: float) -> dict[str, Any]:
        """The probe's entry in the verdict's `probes` (plain msgpack/JSON values)."""
        return {"name": self.name, "passed": self.agrees(bound), "checked": self.checked,
                "max_abs_diff": self.max_abs_diff, "argmax_mismatches": self.argmax_mismatches,
                "max_hidden_diff": (None if math.isnan(self.max_hidden_diff)
                                    else self.max_hidden_diff),
                "groups": self.groups, "error": self.error, **self.extra}


@dataclass
class Answer:
    """One request's eager reference: its row and its last hidden state [tokens, H]."""

    row: RowResult
    hidden: torch.Tensor | None


class Context:
    """What a probe works with: the executor, the bound, and the eager reference, each request
    answered once however many paths are checked against it."""

    def __init__(self, target: WarmTarget, bound: float) -> None:
        self.target = target
        self.bound = bound
        self._references: dict[tuple[Any, ...], Answer] = {}

    def reference(self, encoding: Encoding, slot: int | None = None) -> Answer:
        """The request alone through the plain eager forward (no graphs, no packing), on the
        base or on variant `slot`."""
        # By content: the probes build their requests again for each path checked.
        key = (tuple(encoding.input_ids),
               tuple((q.question_span, q.option_spans) for q in encoding.questions), slot)
        if key not in self._references:
            with reference_runner(self.target.runner) as plain:
                output = plain.run([encoding], slots=() if slot is None else (slot,),
                                   keep_hidden=True)
            self._references[key] = Answer(output.rows[0], output.hidden)
        return self._references[key]

    def compare_groups(self, name: str, groups: Sequence[Sequence[Encoding]],
                       slots: Sequence[Sequence[int]] | None = None,
                       extra: dict[str, Any] | None = None,
                       forced: Sequence[Sequence[int] | None] = ()) -> ProbeResult | None:
        """Every group through the serving path (cut as the serve loop cuts it, each cut one
        runner call, on the variant `slots` given per request) against each request's
        reference; None when there is no group. `forced`: per group, a graph shape the group
        replays whole in one runner call (`ModelRunner.run`'s `shape`), or None (cut as
        served); none given: every group cut as served."""
        encodings = [encoding for group in groups for encoding in group]
        if not encodings:
            return None
        if slots is None and len(self.target.runner.heads) > 1:
            # Variants served: the requests take the base and each variant in turn.
            turns = iter(probe_slots(self.target.runner, len(encodings)))
            slots = [[next(turns) for _ in group] for group in groups]
        references = [self.reference(encoding, None if slots is None else slots[g][m])
                      for g, group in enumerate(groups) for m, encoding in enumerate(group)]
        served: list[RowResult] = []
        group_diffs: list[float] = []
        hidden = 0.0
        try:
            for g, group in enumerate(groups):
                rows: list[RowResult] = []
                shape = forced[g] if g < len(forced) else None
                runs = ([[*range(len(group))]] if shape is not None
                        else cut(self.target, [encoding.length for encoding in group]))
                for members in runs:
                    output = self.target.runner.run(
                        [group[m] for m in members],
                        slots=() if slots is None else [slots[g][m] for m in members],
                        keep_hidden=True, shape=shape)
                    rows += output.rows
                    hidden = max(hidden, self.hidden_diff(
                        output.hidden, [references[_flat(groups, g, m)] for m in members]),
                        key=lambda value: math.inf if math.isnan(value) else value)
                start = _flat(groups, g, 0)
                diff = compare(rows, [r.row for r in references[start:start + len(group)]],
                               group, self.bound)
                group_diffs.append(diff.max_abs_diff)
                served += rows
        except Exception as exc:
            log.error("self-check: the %s path raised on the %s probe's requests",
                      current_path(self.target), name, exc_info=True)
            return ProbeResult(name, len(encodings), 1.0, error=f"{type(exc).__name__}: {exc}",
                               extra=dict(extra or {}))
        comparison = compare(served, [r.row for r in references], encodings, self.bound)
        return ProbeResult(name, len(encodings), comparison.max_abs_diff,
                           comparison.argmax_mismatches, hidden, group_diffs,
                           worst_tokens=comparison.worst_tokens, extra=dict(extra or {}))

    @staticmethod
    def hidden_diff(served: torch.Tensor | None, references: Sequence[Answer]) -> float:
        """The hidden-state difference of a forward's requests, end to end, from their
        references' (0 where a runner returns none)."""
        parts = [answer.hidden for answer in references]
        if served is None or any(part is None for part in parts):
            return 0.0  # a runner that does not return hidden states: nothing to compare
        return hidden_difference(served, torch.cat([p for p in parts if p is not None]))


def _flat(groups: Sequence[Sequence[Encoding]], group: int, member: int) -> int:
    return sum(len(g) for g in groups[:group]) + member


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
# things (the prefix cache's), is clef_worker.check_probes.PROBES.
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

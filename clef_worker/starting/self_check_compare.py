"""The start-up self-check's comparison: each probe request's reference answer, the served
answers against it, and what a probe records (`ProbeResult`).

Why a module of its own: the layout probes (clef_worker.starting.self_check) and the prefix cache's
(clef_worker.starting.prefix_probe) compare the same way, against the same references
(clef_worker.starting.self_check_reference says which kernels those run).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from clef_worker.model.encoding import Encoding
from clef_worker.serving.batching import GroupCutter
from clef_worker.serving.staging import RowResult
from clef_worker.starting.self_check_paths import current_path
from clef_worker.starting.self_check_reference import reference_answer
from clef_worker.starting.variant_probe import probe_slots

if TYPE_CHECKING:
    from clef_worker.starting.warm_requests import WarmTarget

log = logging.getLogger("clef_worker.starting.self_check")



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
        base or on variant `slot`, its kernels the ones serving compiled
        (clef_worker.starting.self_check_reference)."""
        # By content: the probes build their requests again for each path checked.
        key = (tuple(encoding.input_ids),
               tuple((q.question_span, q.option_spans) for q in encoding.questions), slot)
        if key not in self._references:
            self._references[key] = Answer(*reference_answer(self.target.runner, encoding, slot))
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

"""The start-up self-check's serving paths: the names of the paths a worker can serve with, the
order the check falls back along, and the switch from one to the next.

Why a module of its own: the check (clef_worker.starting.self_check) and its comparison
(clef_worker.starting.self_check_compare, which names the path in its log lines) both read them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from clef_worker.serving.policy import PACKED, PADDED, PER_GROUP

if TYPE_CHECKING:
    from clef_worker.starting.warm_requests import WarmTarget


# The paths a worker can serve with, fastest first. `-graphs`: the runner replays fixed shapes
# (captured CUDA graphs; on CPU with `--cuda-graphs on`, the same shapes run eagerly).
PACKED_GRAPHS = "packed-graphs"
PACKED_EAGER = PACKED
PER_GROUP_EAGER = PER_GROUP
PADDED_GRAPHS = "padded-graphs"
PADDED_EAGER = PADDED
ONE_AT_A_TIME = "one-at-a-time"
ORDER = (PACKED_GRAPHS, PACKED_EAGER, PER_GROUP_EAGER, PADDED_GRAPHS, PADDED_EAGER, ONE_AT_A_TIME)


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

"""Which workers may take a ticket: only those that serve the model it names.

Why: workers may serve different fine-tuned variants for a while (a rolling restart after a
checkpoint was added to or removed from a `--finetune` directory, or one worker restarted after
a crash), and a worker must never score a request as another model. So the worker choice is
filtered by one predicate (`serving`), kept apart from how a worker is chosen among those that
fit (the round robin of `ticket.LaneRing`, room, idleness); the base (model "") is served by
every worker. A variant no ready worker serves is refused with 503 (`not_served`), never sent.
"""

from __future__ import annotations

from collections.abc import Callable

from clef_dispatch.outcomes import Refusal
from clef_dispatch.ticket import Lane, Ticket, Workers


def serving(model: str, fits: Callable[[Lane], bool]) -> Callable[[Lane], bool]:
    """`fits`, among the workers that serve `model` only ("": the base, which all serve)."""
    if not model:
        return fits
    return lambda lane: lane.serves(model) and fits(lane)


def unserved(model: str, workers: Workers) -> bool:
    """A variant no ready worker serves now (all restarted without it, or the ones that have
    it are restarting)."""
    return bool(model) and not workers.serving(model)


def not_served(model: str) -> str:
    """The 503 detail for a variant no ready worker serves now."""
    return f"no ready worker serves model {model!r} now"


def refuse(ticket: Ticket, held: bool, refusal: Refusal) -> None:
    """Answer a waiting ticket whose model no ready worker serves with `refusal` (503); a
    suspect's copy (`held`: its original is on a worker) is only withdrawn, and the original
    is answered where it runs."""
    if held:
        ticket.copy_withdrawn()
    elif not ticket.outcome.done():
        ticket.outcome.set_result(refusal)

"""Which workers may take a ticket: only those that serve the model it names.

Why: workers may serve different fine-tuned variants for a while (a rolling restart after a
checkpoint was added to or removed from a `--finetune` directory, or one worker restarted after
a crash), and a worker must never score a request as another model. So the worker choice is
filtered by one predicate (`serving`), kept apart from how a worker is chosen among those that
fit (the round robin of `ticket.LaneRing`, room, idleness); the base (model "") is served by
every worker. A variant no ready worker serves is never sent: it is answered at once
(`no_worker_for`), 503 while a restarting worker still lists it, 404 once none does, and the
queue moves on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from clef_dispatch.affinity import preferred_lane
from clef_dispatch.outcomes import Refusal, RefusalKind
from clef_dispatch.ticket import Lane, LaneRing, Ticket, Workers, has_room, is_idle


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


def no_worker_for(model: str, workers: Workers, retry_after: int) -> Refusal:
    """The answer to a request for a variant no ready worker serves: 503 (retry) while a
    restarting worker served it at its last start, else 404 naming it (its checkpoint was
    removed: every worker started since without it)."""
    if workers.knows(model):
        return Refusal(RefusalKind.UNAVAILABLE, not_served(model), retry_after)
    return Refusal(RefusalKind.UNKNOWN_MODEL,
                   f"unknown model {model!r}: no worker serves it any more (its checkpoint "
                   "was removed)")


def refuse(ticket: Ticket, held: bool, refusal: Refusal) -> None:
    """Answer a waiting ticket whose model no ready worker serves with `refusal`; a
    suspect's copy (`held`: its original is on a worker) is only withdrawn, and the original
    is answered where it runs."""
    if held:
        ticket.copy_withdrawn()
    elif not ticket.outcome.done():
        ticket.outcome.set_result(refusal)


class WorkerChoice:
    """Which worker a ticket goes to: among those serving its model, first the prefix affinity
    rule (affinity.py: the worker whose prefix cache may hold a long state, when it has room
    and is within a load margin of the least loaded), then the least loaded worker with room
    (ties in round-robin order). Workers running a resent ticket alone (`busy_alone`,
    resend.py's) take nothing else. Admission owns when a ticket is sent; this owns where."""

    def __init__(self, workers: Workers, ring: LaneRing,
                 busy_alone: Callable[[], Mapping[Lane, Ticket]]) -> None:
        self._workers = workers
        self._ring = ring
        self._busy_alone = busy_alone

    def lane_for(self, affinity: bytes | None, model: str = "") -> Lane | None:
        """The worker for a ticket with this prefix key and model; None while none has room."""
        busy_alone = self._busy_alone()
        lanes = self._workers.lanes
        if model:
            lanes = [lane for lane in lanes if lane.serves(model)]
        preferred = preferred_lane(affinity, lanes, busy_alone)
        if preferred is not None:
            return preferred
        return self._ring.least_loaded(serving(model, has_room), busy_alone)

    def takes_now(self, model: str) -> bool:
        """Whether some worker serving `model` has room (nothing is chosen)."""
        busy_alone = self._busy_alone()
        return any(lane not in busy_alone and serving(model, has_room)(lane)
                   for lane in self._workers.lanes)

    def room_somewhere(self) -> bool:
        """Whether some worker (not running a resent ticket alone) has room."""
        busy_alone = self._busy_alone()
        return any(lane not in busy_alone and has_room(lane) for lane in self._workers.lanes)

    def idle_lane(self, model: str = "") -> Lane | None:
        """A ready worker serving `model` with nothing in flight, for a resent ticket alone."""
        return self._ring.pick(serving(model, is_idle), self._busy_alone())

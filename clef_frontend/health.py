"""`GET /health`, answered from the front's own state and never queued behind a forward.

Probes must learn the truth even while the workers are busy with long requests, so this reads
only in-memory state: each worker's state and ready info, the queue counters, and the drain
flag (held by admission, which is what refuses requests while draining). With several workers
the server is ready while at least one is: `workers` lists every one (name, device, status, pid,
in_flight, max_batch, restarts, suspect), `ready_workers` names those that serve, and `worker`
is the first ready one's ready info (the single-worker shape). A suspect worker (its pong or
reply overdue, clef_dispatch/liveness.py) is still ready but gets no new work:
`suspect_workers` names them, and when every ready worker is suspect `waiting_for` says why
nothing new is sent.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from clef_dispatch import Admission, WorkerPool
from clef_frontend import responses
from clef_frontend.responses import Reply


class Health:
    """The front's service state, as `/health` reports it."""

    def __init__(self, pool: WorkerPool, admission: Admission, retry_after: int) -> None:
        self._pool = pool
        self._admission = admission
        self._retry_after = retry_after

    def status(self) -> str:
        """ready, starting, restarting or draining (stopped once the worker is gone)."""
        if self._admission.draining:
            return "draining"
        return str(self._pool.state())

    def document(self) -> dict[str, Any]:
        status = self.status()
        worker = None
        ready = self._pool.ready_lanes()
        info = self._pool.ready_info()
        if info is not None:
            worker = {k: v for k, v in asdict(info).items() if k not in ("versions", "snapshot")}
        return {
            "status": status,
            "worker": worker,
            "workers": self._pool.describe(),
            "ready_workers": [lane.slot.name for lane in ready],
            "suspect_workers": [lane.slot.name for lane in self._pool.suspect_lanes()],
            "waiting_for": self._pool.waiting_on_suspects(),
            "queue_depth": self._admission.depth,
            "in_flight": self._admission.in_flight,
            "queue_capacity": self._admission.capacity,
            "restarts": self._pool.restarts,
        }

    def reply(self) -> Reply:
        """200 once the worker is warm and the server is not draining; 503 otherwise."""
        document = self.document()
        if document["status"] == "ready":
            return responses.document(200, document)
        return responses.document(503, document, retry_after=self._retry_after)

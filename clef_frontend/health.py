"""`GET /health`, answered from the front's own state and never queued behind a forward.

Probes must learn the truth even while the workers are busy with long requests, so this reads
only in-memory state: each worker's state and ready info, the queue counters, and the drain
flag (held by admission, which is what refuses requests while draining). With several workers
the server is ready while at least one is: `workers` lists every one (name, device, status, pid,
in_flight, max_batch, restarts, models: the fingerprint of each model it serves, suspect),
`ready_workers` names those that serve, and `worker`
is the first ready one's ready info (the single-worker shape). A suspect worker (its pong or
reply overdue, clef_dispatch/liveness.py) is still ready but gets no new work:
`suspect_workers` names them, and when every ready worker is suspect `waiting_for` says why
nothing new is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from clef_api import responses
from clef_api.responses import Reply
from clef_dispatch import DispatchSnapshot


class Health:
    """The front's service state, as `/health` reports it, from the dispatcher's snapshot."""

    def __init__(self, snapshot: Callable[[], DispatchSnapshot], retry_after: int) -> None:
        self._snapshot = snapshot
        self._retry_after = retry_after

    def status(self) -> str:
        """ready, starting, restarting or draining (stopped once the worker is gone)."""
        return self._snapshot().state

    def document(self) -> dict[str, Any]:
        now = self._snapshot()
        worker = None
        if now.worker is not None:
            worker = {k: v for k, v in asdict(now.worker).items()
                      if k not in ("versions", "snapshot", "fingerprint", "models")}
        return {
            "status": now.state,
            "worker": worker,
            "workers": now.workers,
            "ready_workers": now.ready_workers,
            "suspect_workers": now.suspect_workers,
            "waiting_for": now.waiting_for,
            "queue_depth": now.queue_depth,
            "in_flight": now.in_flight,
            "queue_capacity": now.queue_capacity,
            "restarts": now.restarts,
        }

    def reply(self) -> Reply:
        """200 once the worker is warm and the server is not draining; 503 otherwise."""
        document = self.document()
        if document["status"] == "ready":
            return responses.document(200, document)
        return responses.document(503, document, retry_after=self._retry_after)

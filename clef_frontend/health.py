"""`GET /health`, answered from the front's own state and never queued behind a forward.

Probes must learn the truth even while the worker is busy with a long request, so this reads
only in-memory state: the supervisor's worker state and ready info, the queue counters, and the
drain flag (held by admission, which is what refuses requests while draining).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from clef_frontend import responses
from clef_frontend.admission import Admission
from clef_frontend.responses import Reply
from clef_frontend.supervisor import Supervisor, WorkerState


class Health:
    """The front's service state, as `/health` reports it."""

    def __init__(self, supervisor: Supervisor, admission: Admission, retry_after: int) -> None:
        self._supervisor = supervisor
        self._admission = admission
        self._retry_after = retry_after

    def status(self) -> str:
        """ready, starting, restarting or draining (stopped once the worker is gone)."""
        if self._admission.draining:
            return "draining"
        if self._supervisor.unavailable_reason() is None:
            return "ready"
        state = self._supervisor.state
        return "restarting" if state is WorkerState.READY else str(state)

    def document(self) -> dict[str, Any]:
        status = self.status()
        worker = None
        info = self._supervisor.info
        if info is not None and self._supervisor.unavailable_reason() is None:
            worker = {k: v for k, v in asdict(info).items() if k not in ("versions", "snapshot")}
        return {
            "status": status,
            "worker": worker,
            "queue_depth": self._admission.depth,
            "in_flight": self._admission.in_flight,
            "queue_capacity": self._admission.capacity,
            "restarts": self._supervisor.restarts,
        }

    def reply(self) -> Reply:
        """200 once the worker is warm and the server is not draining; 503 otherwise."""
        document = self.document()
        if document["status"] == "ready":
            return responses.document(200, document)
        return responses.document(503, document, retry_after=self._retry_after)

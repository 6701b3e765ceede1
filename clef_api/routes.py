"""The route table of docs/http-contract.md: which target is which route, 404 and 405.

The checks a scoring request then goes through are checks.py's.
"""

from __future__ import annotations

from enum import Enum

from clef_api import responses, workers_ai
from clef_api.responses import Reply


class Route(Enum):
    """Each route's path and the one method it answers: the route table itself."""

    HEALTH = (b"/health", b"GET")
    SYSTEMONE = (b"/v1/systemone", b"POST")
    MODELS = (b"/v1/models", b"GET")
    WORKERS_AI = (workers_ai.PATH_TEMPLATE.encode("ascii"), b"POST")  # a pattern, not a path
    METRICS = (b"/metrics", b"GET")

    def __init__(self, path: bytes, method: bytes) -> None:
        self.path = path
        self.method = method

    @property
    def is_scoring(self) -> bool:
        """Whether requests on this route are scored by a worker (and measured as such)."""
        return self in _SCORING


_SCORING = frozenset({Route.SYSTEMONE, Route.WORKERS_AI})


# Targets are compared as sent: `/health?x=1` is unknown.
_BY_PATH: dict[bytes, Route] = {known.path: known for known in Route
                                 if known is not Route.WORKERS_AI}



def route(method: bytes, target: bytes) -> Route | Reply:
    """The route table: 404 for unknown targets, 405 with `Allow` for the wrong method."""
    found = _BY_PATH.get(target)
    if found is None and workers_ai.run_target(target) is not None:
        found = Route.WORKERS_AI
    if found is None:
        return responses.error(404, "unknown route")
    if method != found.method:
        return responses.error(405, "method not allowed", allow=found.method.decode("ascii"))
    return found

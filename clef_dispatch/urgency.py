"""How urgently a request wants its answer: its class and its deadline, as admission orders
them.

The class names are owned here (the front's `priority.py` reads them from an HTTP header or a
key, clef-batch submits every line as `interactive`); admission serves waiting `interactive`
requests before `bulk` ones. A deadline is a `time.monotonic()` instant after which a request
still waiting is refused (`RefusalKind.EXPIRED`) rather than sent.
"""

from __future__ import annotations

INTERACTIVE = "interactive"
BULK = "bulk"
CLASSES = (INTERACTIVE, BULK)


def earliest(deadline: float | None, enqueued_at: float, queue_timeout: float | None
             ) -> float | None:
    """The deadline that applies: the request's own or the server's queue timeout, whichever
    comes first (None: neither)."""
    limits = [d for d in (deadline, None if queue_timeout is None
                          else enqueued_at + queue_timeout) if d is not None]
    return min(limits) if limits else None

"""The two ways forwarding a request can fail, shared by the channel, supervisor and admission.

They live apart from the classes that raise them so that admission can tell a 503 from a 500
without importing the process machinery (supervisor, channel) it never calls directly.
"""

from __future__ import annotations


class WorkerFailure(Exception):
    """The worker went away or broke the protocol with a request in flight (answer 500).

    str() is the reason for the log.
    """


class WorkerUnavailable(Exception):
    """No warm worker right now, so nothing was sent (answer 503); str() is the short detail."""


class WorkerLost(WorkerFailure):
    """The worker was lost (it died, stalled, hung or broke the protocol) with the request in
    flight: nothing says the request itself was at fault, and an answer is a pure function of
    the request, so admission may send it again, once, to another worker.

    `reason` is one word for metrics and logs (`clef_requests_resent_total{reason}`).
    """

    reason = "crash"

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

"""A request's outcome and the ways forwarding it can fail, shared by the channel, supervisor
and admission.

They live apart from the classes that raise them so that admission can tell a 503 from a 500
without importing the process machinery (supervisor, channel) it never calls directly.
"""

from __future__ import annotations

from collections.abc import Callable

from clef_protocol import messages
from clef_protocol.messages import WorkerReply


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


# What a request sent to a worker comes to: the worker's reply, or the failure that lost it.
WorkerOutcome = WorkerReply | WorkerFailure
# Called exactly once per submitted request, with its outcome (the channel, the supervisor and
# admission all hand outcomes on through this one shape).
Deliver = Callable[[WorkerOutcome], None]


class WorkerExited(WorkerLost):
    """The worker closed its output: it has exited (or is exiting) on its own."""


class WorkerHung(WorkerLost):
    """The worker did not answer a request within the request timeout."""

    reason = "hung"


class WorkerProtocolError(WorkerLost):
    """The worker wrote something that is not a valid frame or reply (it broke the protocol)."""

    reason = "protocol"


class WorkerStalled(WorkerLost):
    """The worker answered neither a ping nor a request for the stall timeout (wedged)."""

    reason = "stalled"


def failure_reason(failure: WorkerFailure, exit_code: int | None) -> str:
    """Why a warm worker was lost, as one of a few fixed words (a metric label, a log token).

    `cuda_error`: it exited with the status the worker uses after a sticky device error;
    `hung`: it did not answer within the request timeout; `stalled`: it answered neither
    pings nor requests for the stall timeout; `protocol`: it wrote something that is
    not a valid frame, or exited because the front's frame was unreadable; `crash`: anything
    else (it died, was killed, or closed its output).
    """
    if exit_code == messages.EXIT_EXECUTOR_BROKEN:
        return "cuda_error"
    if isinstance(failure, WorkerHung | WorkerStalled):
        return failure.reason
    if isinstance(failure, WorkerProtocolError) or exit_code == messages.EXIT_PROTOCOL_ERROR:
        return "protocol"
    return "crash"


RESTART_REASONS = ("crash", "hung", "protocol", "cuda_error", "stalled")

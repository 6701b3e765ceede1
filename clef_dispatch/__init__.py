"""clef_dispatch: the worker half that `clef-serve` and `clef-batch` both drive.

Everything between a checked request and a worker's reply lives here; the HTTP front
(`clef_frontend`) and `clef_tools.batch_runner` reach the workers only through this package's
names below (never its modules): submit a request, get its outcome.

| module | job |
|---|---|
| `dispatcher.py` | `Dispatcher`, the one door: start, `submit` (a read-only `TicketView` whose |
|  | outcome is an `Answer` or a `Refusal`), `abandon`, `drain`, `snapshot`, stop |
| `outcomes.py` | `Answer`, `Refusal` and its kinds: what a request comes to, free of HTTP |
| `urgency.py` | the priority classes and the deadline that applies |
| `load.py` | the token estimate of a waiting request (the utilisation gauge) |
| `settings.py` | `WorkerSettings` and the one worker argument group both commands add (one |
|  | help text, one validation) |
| `admission.py` | the queue: interactive before bulk, FIFO within a class, bulk never starved; |
|  | the hand-over to the next worker with room |
| `affinity.py` | prefix affinity: a request's prefix key, and the worker whose prefix cache may |
|  | hold its state, preferred while it has room (rendezvous hashing) |
| `routing.py` | which workers may take a ticket: only those serving the model it names (the |
|  | base: all); a variant no ready worker serves is refused (503), never sent |
| `resend.py` | requests lost with a worker sent again once, alone; a suspect's copies; what a |
|  | worker's outcome means for a request (`judge`) |
| `waiting.py` | where tickets wait (`TicketQueue`) and the counts the gauges read: plain ints, |
|  | each ticket once, safe to read from the metrics thread |
| `ticket.py` | `Ticket` (one admitted request) and the `TicketView` drivers hold of it, the |
|  | workers as admission sees them, the round robin over them |
| `deadline_heap.py` | the waiting tickets' deadlines, one timer for all |
| `worker_pool.py` | every worker slot (`--devices`/`--workers`/`--workers-per-device`); |
|  | ready while one is; rolling reload |
| `supervisor.py` | one worker slot: start, notice failure, replace with back-off (give up |
|  | after `max_restarts`, when set), reload without a gap, stop |
| `backoff.py` | how long to wait before a restart, and why (pure) |
| `worker_channel.py` | the framed pipe to one worker: requests outstanding, replies matched by |
|  | frame id, the request watchdog |
| `worker_process.py` | the worker process outside its pipe: its start (own session, stdout |
|  | wired to the channel), a stuck one's stack, the exit |
| `liveness.py` | the rule that judges a worker's silence: suspect, wedged (pure) |
| `liveness_timer.py` | the one timer per worker that pings it and applies the rule |
| `worker_errors.py` | a sent request's `WorkerOutcome` and the one `Deliver` shape; |
|  | `WorkerUnavailable` (nothing sent), `WorkerFailure`, `WorkerLost` (sent again) and the |
|  | restart reasons |
"""

from clef_dispatch.affinity import prefix_key
from clef_dispatch.dispatcher import Dispatcher, DispatchEvents, DispatchSnapshot
from clef_dispatch.load import TokenEstimate, utilisation_gauge
from clef_dispatch.outcomes import (
    EXPIRED_DETAIL,
    SHARED_EXPIRED_DETAIL,
    Answer,
    Outcome,
    Refusal,
    RefusalKind,
)
from clef_dispatch.settings import WorkerSettings, add_worker_arguments, worker_settings_from
from clef_dispatch.supervisor import StartupFailed
from clef_dispatch.ticket import TicketView
from clef_dispatch.urgency import BULK, CLASSES, INTERACTIVE, earliest
from clef_dispatch.worker_errors import RESTART_REASONS

__all__ = [
    "BULK",
    "CLASSES",
    "EXPIRED_DETAIL",
    "INTERACTIVE",
    "RESTART_REASONS",
    "SHARED_EXPIRED_DETAIL",
    "Answer",
    "DispatchEvents",
    "DispatchSnapshot",
    "Dispatcher",
    "Outcome",
    "Refusal",
    "RefusalKind",
    "StartupFailed",
    "TicketView",
    "TokenEstimate",
    "WorkerSettings",
    "add_worker_arguments",
    "earliest",
    "prefix_key",
    "utilisation_gauge",
    "worker_settings_from",
]

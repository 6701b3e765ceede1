"""clef_dispatch: the worker half that `clef-serve` and `clef-batch` both drive.

Everything between a checked request and a worker's reply lives here; the HTTP front
(`clef_frontend`) and `clef_tools.batch_runner` reach the workers only through this package's
names below (never its modules): submit a request, get its outcome.

| module | job |
|---|---|
| `dispatcher.py` | `Dispatcher`, the one entry: start, `submit` (a `Ticket` whose outcome is the |
|  | reply), supervise, stop; one restart, stall, resend-alone and give-up policy |
| `settings.py` | `WorkerSettings` and the one worker argument group both commands add (one |
|  | help text, one validation) |
| `admission.py` | the queue: interactive before bulk, FIFO within a class, bulk never starved; |
|  | deadlines expire waiting requests; requests lost with a worker sent again once, alone; |
|  | the hand-over to the next worker with room |
| `worker_pool.py` | every worker slot (`--devices`/`--workers`/`--workers-per-device`); |
|  | ready while one is; rolling reload |
| `supervisor.py` | one worker slot: start, notice failure, replace with back-off (give up |
|  | after `max_restarts`, when set), reload without a gap, stop |
| `backoff.py` | how long to wait before a restart, and why (pure) |
| `worker_channel.py` | one worker process and its framed pipe: requests outstanding, replies |
|  | matched by frame id, the deadline and ping timer; a stuck worker's stack before the kill |
| `worker_errors.py` | a request's `Outcome` and the one `Deliver` shape; `WorkerUnavailable` |
|  | (503, nothing sent), `WorkerFailure` (500), `WorkerLost` (sent again) |
"""

from clef_dispatch.admission import Admission, Refused, Ticket
from clef_dispatch.dispatcher import Dispatcher, DispatchEvents
from clef_dispatch.settings import WorkerSettings, add_worker_arguments, worker_settings_from
from clef_dispatch.supervisor import StartupFailed
from clef_dispatch.worker_channel import RESTART_REASONS
from clef_dispatch.worker_pool import WorkerPool

__all__ = [
    "RESTART_REASONS",
    "Admission",
    "DispatchEvents",
    "Dispatcher",
    "Refused",
    "StartupFailed",
    "Ticket",
    "WorkerPool",
    "WorkerSettings",
    "add_worker_arguments",
    "worker_settings_from",
]

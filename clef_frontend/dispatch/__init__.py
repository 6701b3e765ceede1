"""Dispatch: the front's worker half, shared by `clef-serve` and `clef-batch`.

Everything between a validated request and a worker's reply lives here; the HTTP half
(`connection`, `http1`, `pipeline`, ...) reaches the workers only through it.

| module | job |
|---|---|
| `admission.py` | the queue: interactive before bulk, FIFO within a class, bulk never starved; |
|  | deadlines expire waiting requests; requests lost with a worker sent again once; the |
|  | hand-over to the next worker with room |
| `worker_pool.py` | every worker slot (`--devices`/`--workers`/`--workers-per-device`); |
|  | ready while one is; rolling reload |
| `supervisor.py` | one worker slot: start, notice failure, replace with back-off, reload |
|  | without a gap, stop |
| `worker_channel.py` | one worker process and its framed pipe: requests outstanding, replies |
|  | matched by id, the deadline and ping timer |
| `worker_errors.py` | `WorkerUnavailable` (503, nothing sent) and `WorkerFailure` (500) |
| `backoff.py` | how long to wait before a restart, and why (pure) |
"""

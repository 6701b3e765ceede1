"""The clef-serve worker: one persistent process that owns the model and the CUDA context.

Run as `python -m clef_worker`; it talks to the front over stdin/stdout frames
(see clef_protocol) and scores every request on its main thread.
"""

from time import perf_counter as _perf_counter

# When the worker's package was first imported: in a worker process the start of its start-up
# (`startup.ready_s` counts from here, clef_worker.starting.startup_clock).
FIRST_IMPORT = _perf_counter()

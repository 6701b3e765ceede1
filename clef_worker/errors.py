"""The worker's two failures that are not about one request.

Owned here, below everything else in the worker, so that model modules (snapshot, backbone,
vision...) can refuse to start or declare the device broken without importing the serving
interface (`clef_worker.executor`).
"""

from __future__ import annotations


class StartupError(Exception):
    """The executor cannot start (missing file, wrong shapes, missing kernel...).

    The message is sent to the front in a `fatal` frame and shown to the operator verbatim, so it
    must name what is wrong (the file, the tensor, the flag).
    """


class ExecutorBroken(Exception):
    """The executor can answer nothing any more, e.g. a CUDA error left the context unusable.

    Raised from `answer`: the worker replies 500 to that request and exits, so the front starts
    a fresh worker instead of failing every later request while `/health` still says ready.
    """

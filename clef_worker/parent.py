"""The worker dies with the process that started it.

Why: the worker runs in its own session (clef_dispatch.worker_process), so signals aimed at the
front's process group do not reach it, and while it loads, warms up and checks itself (tens of
seconds to minutes on a GPU) it reads nothing from its pipe, so it cannot see the front go. A
front killed with SIGKILL, or a benchmark step stopped at its time limit with its process
group, would leave a worker holding GPU memory and competing with whatever starts next.

So the worker asks the kernel (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`) to kill it when its
parent dies. That request only covers deaths after it is made: a front killed between the
fork and the request has already left the worker with another parent. The front puts its pid
in the worker's environment (`FRONT_PID_ENV`), so after the request the worker compares its
parent with it; a different parent and no process of that pid means the front is gone, and
the worker exits at once. (A different parent while the front lives is a wrapper of a
`--worker-command` between them, and the worker then dies with that wrapper.) On systems
without prctl the worker still ends when its pipe closes, once it serves.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Mapping

from clef_protocol.messages import FRONT_PID_ENV

log = logging.getLogger("clef_worker.parent")

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process holds the pid: alive, not ours to judge
    return True


def die_with_parent(environ: Mapping[str, str] | None = None) -> bool | None:
    """Ask for SIGKILL when the parent dies; True when asked, False where the platform cannot,
    None when the front is already gone (the caller exits)."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    # prctl is variadic: each argument passed as the unsigned long the kernel reads.
    zero = ctypes.c_ulong(0)
    if libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(int(signal.SIGKILL)), zero,
                  zero, zero) != 0:
        log.warning("cannot ask to die with the front (prctl: %s): a front killed while this "
                    "worker starts leaves it running", os.strerror(ctypes.get_errno()))
        return False
    try:
        front = int(env.get(FRONT_PID_ENV, "0"))
    except ValueError:
        front = 0
    if front > 0 and os.getppid() != front and not _alive(front):
        return None
    return True

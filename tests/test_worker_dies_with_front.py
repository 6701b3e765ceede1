"""No worker outlives its front (clef_worker.parent).

A front killed with SIGKILL cannot drain or stop its workers, and a worker that is still loading,
warming up or checking itself reads nothing from its pipe, so it would run on, holding its
device. Each worker asks the kernel to kill it with its parent; these tests kill a real front
while its workers start and find none left, and check the race the request leaves open (a front
gone before the worker made it) in a process of its own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchlib.serve import Serve
from clef_protocol.messages import FRONT_PID_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")

LOADED = re.compile(r"loaded clef-flash from")
READY = re.compile(r"ready in \d+ ms")


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (reaped or not, a zombie has stopped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)  # polling interval, not a synchronisation guess
    return bool(condition())  # type: ignore[operator]


def test_sigkill_of_the_front_leaves_no_worker(tiny_snapshot: Path) -> None:
    """Two real workers (production defaults but the model and their count), the front
    SIGKILLed as soon as one has loaded the model and is warming up and checking itself (the
    other is at most as far): every worker is gone, and none got as far as `ready` (without the
    kernel's help each would run until its `ready` frame met the closed pipe)."""
    with Serve(real_worker=True, wait_listening=False,
               front_args=("--model", str(tiny_snapshot), "--device", "cpu",
                           "--workers-per-device", "2")) as server:
        front = server.process.pid
        assert wait_until(lambda: LOADED.search(server.stderr) is not None, 240), server.stderr
        workers = children(front)
        assert len(workers) == 2, (workers, server.stderr)
        try:
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)
            assert wait_until(lambda: not any(running(pid) for pid in workers), 30), \
                f"workers still running after the front's SIGKILL: {workers}"
            assert not READY.search(server.stderr), server.stderr
        finally:
            for pid in workers:
                if running(pid):
                    os.kill(pid, signal.SIGKILL)


PROBE = ("import sys; from clef_worker.parent import die_with_parent; "
         "print(die_with_parent({sys.argv[1]: sys.argv[2]}))")


def _die_with_parent(front: int) -> str:
    return subprocess.run([sys.executable, "-c", PROBE, FRONT_PID_ENV, str(front)],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_a_front_gone_before_the_request_is_noticed() -> None:
    """The worker's parent is not the front it was told of, and no such process exists: the
    front died before the worker asked to die with it, so the worker must exit (None)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    assert _die_with_parent(gone.pid) == "None"
    assert _die_with_parent(os.getpid()) == "True"  # the parent is the front
    assert _die_with_parent(0) == "True"  # not started by a front: nothing to compare

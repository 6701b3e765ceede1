"""A worker process's life outside its pipe: the stack of a stuck one, and its exit.

Apart from the channel (worker_channel.py: frames, replies, the request watchdog and the
liveness timer), because these act on the process whatever its pipe says: a worker killed as
hung or stalled is first sent `STACK_DUMP_SIGNAL` (and SIGCONT, should it be stopped): it writes
every thread's stack to the log and exits, so the log says where it was stuck; one still there
`STACK_DUMP_SECONDS` later is SIGKILLed (gunicorn's SIGABRT-then-SIGKILL, without the core
file). Every process is reaped, so no zombie is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from clef_protocol import messages

log = logging.getLogger("clef_dispatch.worker_process")


async def dump_stack(process: asyncio.subprocess.Process) -> None:
    """Ask a stuck worker for its stack (`STACK_DUMP_SIGNAL`; SIGCONT wakes a stopped one),
    which it writes before it exits; wait for the exit up to `STACK_DUMP_SECONDS`."""
    if process.returncode is not None:
        return
    log.warning("worker pid=%d is stuck: asking for its stack (signal %s) before the kill",
                process.pid, messages.STACK_DUMP_SIGNAL.name)
    for handler in logging.getLogger("clef_dispatch").handlers:
        handler.flush()  # this line before the stack, not in the middle of one of its lines
    try:
        process.send_signal(messages.STACK_DUMP_SIGNAL)
        process.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), messages.STACK_DUMP_SECONDS)


async def exit_code(process: asyncio.subprocess.Process, grace: float) -> int | None:
    """Wait up to `grace` for the exit, then SIGKILL; always reap."""
    if process.returncode is None and grace > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), grace)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    code = await process.wait()
    if process.stdin is not None:
        process.stdin.close()
    return code

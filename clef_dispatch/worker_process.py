"""A worker process's life outside its pipe: its start, the stack of a stuck one, its exit.

Apart from the channel (worker_channel.py: frames, replies, the request watchdog and the
liveness timer), because these act on the process whatever its pipe says.

Start (`start_worker`): the worker runs in its own session with stdin and stdout piped and
stderr inherited; the bytes on its stdout go straight to the channel's callbacks.
The channel exists before the process, not after: output may arrive as soon as the pipes are
connected, before the start returns, and must already have somewhere to go.

Stack and exit: a worker killed as hung or stalled is first sent `STACK_DUMP_SIGNAL` (and
SIGCONT, should it be stopped): it writes every thread's stack to the log and exits, so the log
says where it was stuck; one still there `STACK_DUMP_SECONDS` later is SIGKILLed (gunicorn's
SIGABRT-then-SIGKILL, without the core file). Every process is reaped, so no zombie is left
behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping

from clef_dispatch.worker_errors import WorkerFailure
from clef_protocol import messages

log = logging.getLogger("clef_dispatch.worker_process")


class _Pipes(asyncio.subprocess.SubprocessStreamProtocol):
    """The worker's pipes: stdin stays a StreamWriter; stdout goes straight to the channel.

    Decoding replies in the pipe's own callback, instead of in a task reading a StreamReader,
    saves an event-loop turn per reply: the reply reaches its request the moment it arrives.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[bytes], None],
                 on_output_end: Callable[[], None]) -> None:
        super().__init__(limit=2**16, loop=loop)
        self._on_output = on_output
        self._on_output_end = on_output_end

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        if fd == 1:
            assert isinstance(data, bytes)
            self._on_output(data)
        else:
            super().pipe_data_received(fd, data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        super().pipe_connection_lost(fd, exc)
        if fd == 1:
            self._on_output_end()


async def start_worker(argv: tuple[str, ...], env: Mapping[str, str] | None, *,
                       on_output: Callable[[bytes], None],
                       on_output_end: Callable[[], None]) -> asyncio.subprocess.Process:
    """Start the worker: each chunk of its stdout goes to `on_output` (in the pipe's callback),
    then `on_output_end` once it closes; stderr is inherited so its log lines reach ours and
    never fill a pipe.

    `env` adds to (or overrides in) the front's environment, e.g. the worker's
    `CUDA_VISIBLE_DEVICES`.

    The worker gets its own session: signals aimed at the front's process group (Ctrl-C,
    timeout(1), job control) reach only the front, which drains and then stops the worker
    with a `shutdown` frame, instead of killing the request in flight. A front that dies
    without draining (SIGKILL, a crash) takes its workers with it: each one asked the kernel
    for SIGKILL on its parent's death (clef_worker.parent), knowing the front by
    `FRONT_PID_ENV`. Called from the event loop's thread, which lives as long as the front
    (the kernel signals when the thread that started the child ends).
    """
    loop = asyncio.get_running_loop()
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Pipes(loop, on_output, on_output_end),
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=None,
            start_new_session=True,
            env={**os.environ, **(env or {}), messages.FRONT_PID_ENV: str(os.getpid())},
        )
    except OSError as exc:
        raise WorkerFailure(f"cannot run worker command {argv[0]!r}: {exc}") from None
    return asyncio.subprocess.Process(transport, protocol, loop)


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

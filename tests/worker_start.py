"""A worker started in the test's own process, as `python -m clef_worker` starts: shared by the
self-check tests, so no test module imports another."""

from __future__ import annotations

import io
from pathlib import Path

from clef_protocol.frames import read_frame_blocking
from clef_worker.main import parse_args, start
from clef_worker.native import NativeExecutor


def start_worker(snapshot: Path | str, *flags: str) -> tuple[NativeExecutor | None, dict]:
    """A CPU worker on `snapshot` with `flags`: its executor (None if it refused to start) and
    its first frame (`ready`, or `fatal` with the reason)."""
    channel = io.BytesIO()
    executor = start(parse_args(["--model", str(snapshot), "--device", "cpu", *flags]), channel)
    channel.seek(0)
    frame = read_frame_blocking(channel)
    assert frame is not None
    assert executor is None or isinstance(executor, NativeExecutor)
    return executor, frame

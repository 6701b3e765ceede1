"""Keep the frame channel private before any other code can touch fd 0 or fd 1.

The worker's stdout carries frames and nothing else. A stray `print` in a library, a warning
routed to stdout, or a C extension writing to fd 1 would corrupt the stream, so the very first
thing the worker does is move the channel onto private duplicates of fd 0 and fd 1, then point
fd 1 (and `sys.stdout`) at stderr and fd 0 at /dev/null. Anything written to "stdout" from then
on lands in the log; the frames go through descriptors nobody else knows about.
"""

from __future__ import annotations

import os
import sys
from typing import BinaryIO


def claim_channel() -> tuple[BinaryIO, BinaryIO]:
    """Return (reader, writer) for the frame channel; fds 0/1 no longer reach the front."""
    sys.stdout.flush()
    channel_in = os.dup(0)
    channel_out = os.dup(1)  # os.dup returns non-inheritable fds: children never get them
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull)  # noqa: SIM115 - replaces the interpreter's stdin for good
    return os.fdopen(channel_in, "rb", buffering=0), os.fdopen(channel_out, "wb")

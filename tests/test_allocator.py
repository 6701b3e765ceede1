"""The worker's allocator settings: large blocks come from the heap, and the operator's own
choice is kept."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from clef_worker.allocator import operator_choice

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# Allocates a 16 MiB block and prints how many separate mappings that added: 1 under glibc's
# default mmap threshold, 0 under ours (the block comes from the heap).
PROBE = """
import ctypes, sys
from clef_worker.allocator import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
taken = keep_freed_memory() if sys.argv[1] == "tuned" else None
before = libc.mallinfo2().hblks
block = libc.malloc(16 * 1024 * 1024)
print(taken, libc.mallinfo2().hblks - before)
libc.free(block)
"""


@pytest.mark.skipif(not GLIBC, reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize(("mode", "expected"), [("default", "None 1"), ("tuned", "True 0")])
def test_large_blocks_come_from_the_heap_once_tuned(mode: str, expected: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                            env=env, check=True)
    assert result.stdout.split("\n")[0] == expected


def test_the_operators_choice_is_kept() -> None:
    assert operator_choice({}) is None
    assert operator_choice({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) is not None
    assert operator_choice({"MALLOC_TRIM_THRESHOLD_": "0"}) == "MALLOC_TRIM_THRESHOLD_=0"
    assert operator_choice({"LD_PRELOAD": "/usr/lib/libfaketime.so"}) is None

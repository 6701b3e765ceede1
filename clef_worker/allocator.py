"""Keep glibc's allocator from handing memory back to the kernel between forwards.

Why: a CPU forward allocates and frees intermediates of several MiB (a batch of eight ~450-token
rows makes Gated DeltaNet intermediates of 1-4 MiB each). glibc serves blocks above its mmap
threshold (128 KiB at start, raised dynamically only as far as freed blocks go) with a fresh
`mmap` and returns them with `munmap`, and trims the top of the heap on every large free; the
next forward then page-faults every page back in, zero-filled. PyTorch's own CPU allocator does
not cache, so this is the place. What it is worth depends on what else allocates: on the tiny
fixture (2-core AMD EPYC, one torch thread) it took a batch of eight from 13.3 to 10.1 ms a
request while the head still ran per request; with the head batched, paired worker runs gave
C8 batched 85 and 94 req/s with it against 76 and 91 without, about the run-to-run noise
(docs/benchmarks.md has the commands).

So the worker raises the mmap threshold to glibc's maximum (32 MiB on 64-bit: larger blocks
still get their own mapping) and the trim threshold to 1 GiB, once, before loading the model.
Resident memory then stays at the peak of the largest forward instead of shrinking after it,
which is what a long-lived server wants anyway. An operator who set `MALLOC_*_` variables or
preloads another allocator (jemalloc, tcmalloc) keeps that choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more on 64-bit (half of HEAP_MAX_SIZE)
TRIM_THRESHOLD = 1024 * 1024 * 1024
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def operator_choice(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """What the operator already chose for the allocator, or None."""
    preload = environ.get("LD_PRELOAD", "")
    if "malloc" in preload:  # jemalloc, tcmalloc, mimalloc
        return f"LD_PRELOAD={preload}"
    for name in OPERATOR_VARIABLES:
        if name in environ:
            return f"{name}={environ[name]}"
    return None


def keep_freed_memory() -> bool:
    """Set the thresholds (see the module docs); True when glibc took them."""
    chosen = operator_choice()
    if chosen is not None:
        log.info("host allocator: left as configured (%s)", chosen)
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    taken = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
             and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if taken:
        log.info("host allocator: glibc keeps freed blocks (mmap threshold %d MiB, trim "
                 "threshold %d MiB)", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.warning("host allocator: glibc refused the mmap/trim thresholds; large CPU "
                    "forwards will page-fault their intermediates in")
    return taken

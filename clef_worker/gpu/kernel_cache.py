"""Compiled kernels and autotune results that survive a restart.

Why: on a GPU the first start compiles fla's Triton kernels and autotunes them (tens of seconds
to minutes); Triton keeps both on disk (fla asks Triton to cache autotune results,
`FLA_CACHE_RESULTS`), in `TRITON_CACHE_DIR`, by default `~/.triton/cache`. In a container that
directory dies with the container, so every restart paid the cold compile again. Unless the
operator set `TRITON_CACHE_DIR`, the worker points it into the service's cache directory (the one
the demo snapshot uses: `$CLEF_SERVE_CACHE`, else `$XDG_CACHE_HOME/clef-serve`, else
`~/.cache/clef-serve`), which a deployment keeps on a volume that outlives the process (in
Kubernetes one that outlives the pod, not an `emptyDir`).

Whether the cache held entries at start-up is reported (`kernel_cache`: warm or cold in `ready`,
`/health` and the worker's ready log line), so a slow start can be told from a broken one.
Must run before the first kernel is compiled (before fla is imported, to be safe).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
FLA_CACHE_RESULTS_ENV = "FLA_CACHE_RESULTS"  # fla: store autotune results in Triton's cache
TRITON_SUBDIR = "triton"


@dataclass(frozen=True)
class KernelCache:
    """Where kernels are cached, whether the operator chose it, and whether it held entries."""

    directory: Path
    from_operator: bool
    warm: bool

    @property
    def state(self) -> str:
        return "warm" if self.warm else "cold"


def service_cache_root() -> Path:
    """The service's cache directory (its one owner is clef_worker.demo.cache)."""
    from clef_worker.demo.cache import default_cache_root

    return default_cache_root()


def prepare_kernel_cache(environ: MutableMapping[str, str] | None = None,
                         root: Path | None = None) -> KernelCache:
    """Default `TRITON_CACHE_DIR` to `<root>/triton` (root: the service's cache directory) and
    `FLA_CACHE_RESULTS` to 1, keeping whatever the operator set; create the directory and say
    whether it already held entries."""
    env = os.environ if environ is None else environ
    configured = env.get(TRITON_CACHE_ENV)
    if configured:
        directory = Path(configured).expanduser()
    else:
        directory = (root if root is not None else service_cache_root()) / TRITON_SUBDIR
        env[TRITON_CACHE_ENV] = str(directory)
    env.setdefault(FLA_CACHE_RESULTS_ENV, "1")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        warm = any(directory.iterdir())
    except OSError as exc:
        log.warning("kernel cache %s is not usable (%s): kernels compile at every start",
                    directory, exc)
        warm = False
    cache = KernelCache(directory=directory, from_operator=bool(configured), warm=warm)
    log.info("kernel cache %s (%s, %s)", directory, cache.state,
             f"{TRITON_CACHE_ENV} from the environment" if configured else "default")
    return cache

"""Compiled kernels and autotune results that survive a restart.

Why: on a GPU the first start compiles fla's Triton kernels and autotunes them (tens of seconds
to minutes); Triton keeps both on disk (fla asks Triton to cache autotune results,
`FLA_CACHE_RESULTS`), in `TRITON_CACHE_DIR`, by default `~/.triton/cache`. In a container that
directory dies with the container, so every restart paid the cold compile again. Unless the
operator set `TRITON_CACHE_DIR`, the worker points it into the service's cache directory (the one
the demo snapshot uses: `$CLEF_SERVE_CACHE`, else `$XDG_CACHE_HOME/clef-serve`, else
`~/.cache/clef-serve`), which a deployment keeps on a volume that outlives the process (in
Kubernetes one that outlives the pod, not an `emptyDir`).

Keyed: Triton's own entries are named by the kernel's source and constants and the GPU's
architecture, but fla's autotune results are keyed by shapes alone, and a cache directory filled
for other model dimensions, another GPU or another Triton, torch or fla reported itself `warm`
while every kernel compiled again (the first H200 sitting: a tiny snapshot on Clef-Flash's warm
cache was not ready after 100 s). So the worker uses one subdirectory per key
(`cache_key`: the GPU's name and compute capability, the CUDA, torch, Triton and fla versions,
the dtype and the model's kernel dimensions), under `TRITON_CACHE_DIR` when the operator set it
(then the base) or `<service cache>/triton`: `kernel_cache` reports whether that key's own
directory held entries, and a cache moved between hosts or built ahead of time
(`clef-serve warm-cache`, docs/operations.md) is only ever used by the GPU, libraries and
dimensions it was built for. fla's autotune results live in the same directory
(`FLA_CACHE_RESULTS`), so one volume and one key hold the whole compiled cache.

Whether the cache held entries at start-up is reported (`kernel_cache`: warm or cold in `ready`,
`/health` and the worker's ready log line), so a slow start can be told from a broken one.
Must run before the first kernel is compiled (before fla is imported, to be safe).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
FLA_CACHE_RESULTS_ENV = "FLA_CACHE_RESULTS"  # fla: store autotune results in Triton's cache
TRITON_SUBDIR = "triton"
KEY_FILE = "key.json"  # in each keyed directory: what its key holds, for an operator to read
# The model dimensions the compiled kernels and their autotune results depend on (text_config).
KERNEL_DIMENSIONS = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                     "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_value_head_dim", "intermediate_size")


@dataclass(frozen=True)
class KernelCache:
    """Where kernels are cached, whether the operator chose it, and whether it held entries."""

    directory: Path
    from_operator: bool
    warm: bool
    key: str = ""

    @property
    def state(self) -> str:
        return "warm" if self.warm else "cold"


def service_cache_root() -> Path:
    """The service's cache directory (its one owner is clef_worker.demo.cache)."""
    from clef_worker.demo.cache import default_cache_root

    return default_cache_root()


def cache_key(parts: Mapping[str, Any]) -> str:
    """The subdirectory name for a key's parts: 16 hex digits of their canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def key_parts(device: Any, dtype: str, text_config: Mapping[str, Any]) -> dict[str, Any]:
    """What a compiled kernel and its autotune results depend on besides their source: the GPU
    (name and compute capability), CUDA, torch, Triton and fla, the dtype and the model's
    kernel dimensions (KERNEL_DIMENSIONS)."""
    import torch

    from clef_worker.versions import package_version

    gpu: dict[str, Any] = {"type": getattr(device, "type", str(device))}
    if gpu["type"] == "cuda":
        gpu["name"] = torch.cuda.get_device_name(device)
        gpu["capability"] = list(torch.cuda.get_device_capability(device))
    return {"gpu": gpu, "cuda": torch.version.cuda or "", "torch": torch.__version__,
            "triton": package_version("triton"), "fla": package_version("fla-core"),
            "dtype": dtype,
            "dimensions": {name: text_config[name] for name in KERNEL_DIMENSIONS
                           if name in text_config}}


def prepare_kernel_cache(environ: MutableMapping[str, str] | None = None,
                         root: Path | None = None,
                         parts: Mapping[str, Any] | None = None) -> KernelCache:
    """Point `TRITON_CACHE_DIR` at the key's own subdirectory (`cache_key(parts)`; no parts:
    the base itself) of the base: the operator's `TRITON_CACHE_DIR`, else `<root>/triton`
    (root: the service's cache directory); `FLA_CACHE_RESULTS` to 1 unless set. Create the
    directory (with its `key.json`) and say whether it already held entries."""
    env = os.environ if environ is None else environ
    configured = env.get(TRITON_CACHE_ENV)
    base = (Path(configured).expanduser() if configured
            else (root if root is not None else service_cache_root()) / TRITON_SUBDIR)
    key = cache_key(parts) if parts is not None else ""
    # Already the key's own (a second executor in one process): not keyed twice.
    directory = base / key if key and base.name != key else base
    env[TRITON_CACHE_ENV] = str(directory)
    env.setdefault(FLA_CACHE_RESULTS_ENV, "1")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        warm = any(entry.name != KEY_FILE for entry in directory.iterdir())
        if parts is not None and not (directory / KEY_FILE).exists():
            (directory / KEY_FILE).write_text(json.dumps(parts, sort_keys=True, indent=1))
    except OSError as exc:
        log.warning("kernel cache %s is not usable (%s): kernels compile at every start",
                    directory, exc)
        warm = False
    cache = KernelCache(directory=directory, from_operator=bool(configured), warm=warm, key=key)
    log.info("kernel cache %s (%s, %s%s)", directory, cache.state,
             f"under {TRITON_CACHE_ENV} from the environment" if configured else "default",
             f", key {key}" if key else "")
    return cache

"""A passing start-up self-check, kept so that a restart on the same everything skips it.

Why: the self-check (clef_worker.starting.self_check) answers its probe requests twice, through the
serving layout and eagerly; on a GPU a cold one also compiles kernels the serving path never
uses, tens of seconds. A worker restarted after a crash or a stall, on weights and code that
have not changed since the last passing check, would pay that again for the same answer.

So a verdict that passed on the layout asked for (no fallback, no probe's remedy applied) is
written to a small JSON file, named by the digest of its key, and a later start whose key is the
same keeps it (`reused: true` in the verdict, `/health`'s `worker.self_check.reused`) instead of
running the check. The key (`verdict_key`) holds everything the answers depend on:

- the weights: the snapshot's fingerprint (clef_worker.fingerprint: every file's bytes, so files
  replaced in place change it) and each fine-tuned variant's, computed the same way;
- the code: the clef-serve version, the commit it was built from (clef_protocol.build_info) and
  a digest of the worker's and the protocol's source files (an edited checkout keeps its commit);
- the libraries: torch, transformers, tokenizers, safetensors, fla, triton;
- the device (its name: another GPU model is another key), the dtype, the kernels chosen, and
  the environment variables that change which kernels fla and Triton build (`FLA_*`,
  `TRITON_*`, less those that only say where files go: `kernel_environment`);
- the serving path, the batch policy, the graph buckets, the request limits, and whether the
  prefix cache is on (with its block size and capacity: the `prefix` probe checks it only then,
  and its requests are sized by the block);
- the check itself: `CHECK_VERSION` and the probes' names (a probe added changes the key).

Any change runs the check again. A verdict that failed, passed only after falling back, or
passed only because a remedy turned something off (the prefix cache) is never kept: the next
start checks again and logs the ERROR again. `--self-check report` neither reads nor writes (a
benchmark wants the figures of this start, and its weights may be built in memory rather than
read from the files the fingerprint covers); nor does `off`. Without a fingerprint (no snapshot
directory) nothing is kept.

Where: `$CLEF_SELF_CHECK_DIR` when set, else `self-check/` in the service's cache directory (the
one the demo snapshot and the kernel cache use: `$CLEF_SERVE_CACHE`, else
`$XDG_CACHE_HOME/clef-serve`, else `~/.cache/clef-serve`), which a deployment keeps on a volume.
Each file is written beside its final name and renamed over it, so a reader never sees half of
one and two workers saving at once each leave a whole file. Losing the directory costs one
check; an unreadable or malformed file reads as absent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_protocol.messages import SelfCheck
from clef_worker.versions import package_version

if TYPE_CHECKING:
    from clef_worker.starting.self_check import Probe
    from clef_worker.starting.warm_requests import WarmTarget

log = logging.getLogger("clef_worker.starting.verdict_store")

DIRECTORY_ENV = "CLEF_SELF_CHECK_DIR"
SUBDIR = "self-check"
MAX_KEPT = 64  # verdict files kept; the oldest go first
FORMAT = 1
# The modes that read and write kept verdicts (`report` and `off` do neither).
REUSING_MODES = ("on", "strict")
# The packages whose source decides the worker's answers.
SOURCE_PACKAGES = ("clef_worker", "clef_protocol")
# Environment variables that change the kernels fla and Triton build or choose (fla's backend,
# its autotuning, Triton's compiler options), by prefix; less those that only name where files
# go, which a kernel cache moved to another volume must not invalidate.
KERNEL_ENV_PREFIXES = ("FLA_", "TRITON_")
LOCATION_ONLY_ENV = frozenset(("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR",
                               "TRITON_OVERRIDE_DIR", "TRITON_CACHE_MANAGER"))


def kernel_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment's kernel settings (KERNEL_ENV_PREFIXES, less LOCATION_ONLY_ENV)."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in sorted(env.items())
            if name.startswith(KERNEL_ENV_PREFIXES) and name not in LOCATION_ONLY_ENV}


def default_directory() -> Path:
    """`$CLEF_SELF_CHECK_DIR`, else `self-check/` in the service's cache directory."""
    configured = os.environ.get(DIRECTORY_ENV)
    if configured:
        return Path(configured).expanduser()
    from clef_worker.demo.cache import default_cache_root

    return default_cache_root() / SUBDIR


def source_digest(packages: Sequence[str] = SOURCE_PACKAGES) -> str:
    """The SHA-256 of the packages' `.py` files (relative path and bytes, in path order)."""
    import importlib

    total = hashlib.sha256()
    for name in packages:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for path in sorted(root.rglob("*.py")):
            relative = f"{name}/{path.relative_to(root).as_posix()}".encode()
            data = path.read_bytes()
            total.update(len(relative).to_bytes(4, "big") + relative)
            total.update(len(data).to_bytes(8, "big") + data)
    return total.hexdigest()


def device_name(executor: WarmTarget) -> str:
    """The device's model name (a GPU's, as CUDA names it), or its type."""
    device = executor.device
    if device.type == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    return device.type


def verdict_key(executor: WarmTarget, fingerprint: str, probes: Sequence[Probe],
                variants: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """What a kept verdict must match (module docs); None without a weights fingerprint."""
    if not fingerprint:
        return None
    from clef_protocol.build_info import commit
    from clef_worker.starting.self_check import CHECK_VERSION, current_path

    model = executor.describe()
    graphs = executor.runner.graphs
    return {
        "format": FORMAT,
        "check": {"version": CHECK_VERSION, "probes": [probe.name for probe in probes]},
        "weights": {"fingerprint": fingerprint,
                    "variants": dict(sorted((variants or {}).items())), "variant": model.variant},
        "code": {"version": package_version("clef-serve"), "commit": commit() or "unknown",
                 "source": source_digest()},
        "versions": {**model.versions, "triton": package_version("triton")},
        "device": device_name(executor), "dtype": model.dtype,
        "kernels": {"gdn_path": model.gdn_path, "short_conv": model.short_conv},
        "environment": kernel_environment(),
        "path": current_path(executor),
        "policy": executor.policy.ready_fields(),
        "buckets": sorted(graphs.describe().get("buckets") or ()) if graphs is not None else [],
        "prefix_cache": prefix_cache_key(executor),
        "limits": dataclasses.asdict(executor.limits),
    }


def prefix_cache_key(executor: WarmTarget) -> dict[str, Any] | None:
    """What the `prefix` probe checked: whether the cache is on, its block and its capacity (a
    verdict from a start with the cache off never probed it)."""
    cache = executor.runner.prefix_cache
    if cache is None or not cache.enabled:
        return None
    return {"block_tokens": cache.block_tokens, "capacity_bytes": cache.capacity_bytes}


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def keepable(verdict: SelfCheck) -> bool:
    """A verdict to keep: passed on the layout asked for, and no probe's remedy turned anything
    off (a kept verdict skips the check, so the remedy would not be applied again)."""
    return (verdict.passed and not verdict.fell_back_from
            and not any("remedy" in probe for probe in verdict.probes))


class VerdictStore:
    """Passing verdicts by key, one JSON file each in `directory` (None: keep nothing)."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _path(self, key: Mapping[str, Any]) -> Path | None:
        return None if self.directory is None else self.directory / f"{key_digest(key)}.json"

    def load(self, key: Mapping[str, Any]) -> SelfCheck | None:
        """The verdict kept for exactly this key, if one passed without a fallback."""
        path = self._path(key)
        if path is None:
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(key)):
                return None
            verdict = SelfCheck.from_message(data["verdict"])
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return None
        return verdict if keepable(verdict) else None

    def save(self, key: Mapping[str, Any], verdict: SelfCheck) -> bool:
        """Keep a verdict that passed without a fallback (atomically); whether it was kept."""
        path = self._path(key)
        if path is None or not keepable(verdict):
            return False
        record = {"format": FORMAT, "key": key, "saved_at": time.time(),
                  "verdict": dataclasses.asdict(dataclasses.replace(verdict, reused=False))}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".verdict-")
        except OSError as exc:
            log.info("cannot keep the self-check's verdict in %s (%s): the next start checks "
                     "again", path.parent, exc)
            return False
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump(record, out, sort_keys=True)
            os.replace(temporary, path)
        except OSError as exc:
            log.info("cannot keep the self-check's verdict in %s (%s): the next start checks "
                     "again", path, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            return False
        self._prune()
        return True

    def _prune(self) -> None:
        """Keep the MAX_KEPT most recent verdicts (old weights and code leave theirs behind)."""
        assert self.directory is not None
        with contextlib.suppress(OSError):
            files = sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime,
                           reverse=True)
            for stale in files[MAX_KEPT:]:
                stale.unlink(missing_ok=True)


def checked(executor: WarmTarget, mode: str, fingerprint: Callable[[], str],
            store: VerdictStore | None = None,
            variants: Callable[[], Mapping[str, str]] = dict) -> SelfCheck | None:
    """The start-up self-check's verdict: the kept one where the mode reads it and the key is
    the same (`reused`), else the check run now (kept when it passes without a fallback).
    `fingerprint` waits for the weights' digest (hashed while the worker warmed up), `variants`
    for each fine-tuned variant's (the same `ready.models` reports: one hashing, one thread)."""
    from clef_worker.starting.check_probes import PROBES
    from clef_worker.starting.self_check import run_self_check

    if mode not in REUSING_MODES:
        return run_self_check(executor, mode, PROBES)
    started = time.perf_counter()
    store = store if store is not None else VerdictStore(default_directory())
    key = verdict_key(executor, fingerprint(), PROBES, variants())
    if key is not None:
        kept = store.load(key)
        if kept is not None:
            took = round((time.perf_counter() - started) * 1000.0, 1)
            log.info("self-check passed on %s at an earlier start with the same weights, code, "
                     "device, dtype and layout (%s): kept, not run again (%.0f ms)",
                     kept.layout, store.directory, took)
            return dataclasses.replace(kept, reused=True, ms=took, mode=mode)
    verdict = run_self_check(executor, mode, PROBES)
    if key is not None and verdict is not None and store.save(key, verdict):
        log.info("self-check verdict kept in %s for the next start", store.directory)
    return verdict

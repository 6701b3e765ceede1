"""The demo snapshot cache: generate once, publish atomically, reuse while nothing changed.

The snapshot lives under

    $CLEF_SERVE_CACHE/demo-v<FORMAT>-<fingerprint>/          (if CLEF_SERVE_CACHE is set)
    $XDG_CACHE_HOME/clef-serve/demo-v<FORMAT>-<fingerprint>/  (else, if XDG_CACHE_HOME is set)
    ~/.cache/clef-serve/demo-v<FORMAT>-<fingerprint>/         (else)

The fingerprint hashes the generator format, the shape parameters and the versions of the
libraries whose output ends up in the files (transformers writes config.json, tokenizers trains
the vocabulary, torch draws the numbers), so an upgrade gets a fresh snapshot instead of a stale
one. The directory is built beside its final place and renamed into it, so a crash or two workers
starting at once never leave a half-written snapshot behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from clef_worker.demo import generate
from clef_worker.demo.spec import DEFAULT_SPEC, DEMO_FORMAT, DemoSpec
from clef_worker.errors import StartupError
from clef_worker.model.snapshot import RANDOM_MARKER
from clef_worker.versions import package_versions

log = logging.getLogger("clef_worker.demo")

CACHE_ENV = "CLEF_SERVE_CACHE"

_STALE_TEMP_SECONDS = 3600.0


def default_cache_root() -> Path:
    """Where cached demo snapshots live (see the module docstring for the order of precedence)."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "clef-serve"


def demo_snapshot_name(spec: DemoSpec = DEFAULT_SPEC) -> str:
    """The cache directory name: format version plus a fingerprint of everything that shapes it."""
    identity = json.dumps(
        {"format": DEMO_FORMAT, "spec": asdict(spec), "versions": package_versions()},
        sort_keys=True,
    )
    return f"demo-v{DEMO_FORMAT}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def ensure_demo_snapshot(
    cache_dir: Path | None = None,
    spec: DemoSpec = DEFAULT_SPEC,
) -> Path:
    """Return the cached demo snapshot directory, generating it first if it is not there yet.

    `cache_dir` is the cache *root* (default `default_cache_root()`); the snapshot is the
    `demo-v<FORMAT>-<fingerprint>` directory inside it. Raises StartupError (shown to the
    operator) when the snapshot cannot be generated, e.g. the cache is not writable.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    final = root / demo_snapshot_name(spec)
    if (final / RANDOM_MARKER).is_file():
        log.info("demo snapshot: using cached %s", final)
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(root, final.name)
        temp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    except OSError as exc:
        raise StartupError(f"cannot create the demo snapshot cache {root}: {exc}") from exc
    try:
        started = time.perf_counter()
        generate.generate_snapshot(temp, spec)
        _fsync_tree(temp)
        try:
            os.rename(temp, final)
        except OSError:
            # Another process finished first (the target exists and is not empty): use theirs.
            if not (final / RANDOM_MARKER).is_file():
                raise
            log.info("demo snapshot: another process generated %s first", final)
        else:
            _fsync_dir(root)
            log.info("demo snapshot: generated %s in %.1f s", final,
                     time.perf_counter() - started)
    except Exception as exc:
        raise StartupError(f"cannot generate the demo snapshot in {root}: {exc}") from exc
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


def _remove_stale_temps(root: Path, name: str) -> None:
    """Delete build directories left by crashed generators (old enough not to be in progress)."""
    now = time.time()
    for entry in root.glob(f".{name}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - entry.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """Make the files durable before the rename publishes them (a crash must not expose zeros)."""
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)



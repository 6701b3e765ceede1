"""The kernel cache a GPU sitting leaves behind and the next one starts from, in one archive.

Why: a cold H200 start spent most of its two minutes compiling and autotuning fla's Triton
kernels; the first sitting kept only the autotune results (`triton-autotune.tar`), so every new
machine compiled everything again. This archive holds the whole cache under `TRITON_CACHE_DIR`
(where fla keeps its autotune results too, `FLA_CACHE_RESULTS`): every compiled kernel's binary
and metadata, Triton's launcher modules and the autotune results, as Triton's own
`TRITON_STORE_BINARY_ONLY` would store them (the intermediate IR text is left out: a cache hit
reads the binary and its metadata only, and the IR is most of the bytes).

Triton records a kernel's files by absolute path (`__grp__*.json`), so the archive stores them
relative to the cache and seeding writes them back as absolute paths under the new cache: the
cache may live elsewhere on the next machine. The archive names what it was built with (GPU,
Triton, torch: `kernel-cache.json` inside it); a different key seeds nothing, so a cache from
another GPU or another Triton is never used. Compressed, it must fit the device's 16 MiB per
returned file: past `cap_bytes` the oldest kernels are left out and the manifest says the cache
is incomplete. An archive of the first sitting's kind (`triton-autotune.tar`, autotune results
only, no key) still seeds those results, as before.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ARCHIVE = "kernel-cache.tar.gz"  # in $OUT; copy it to .gpu/ to seed the next sitting
LEGACY_ARCHIVE = "triton-autotune.tar"  # the first sitting's: autotune results only
MANIFEST = "kernel-cache.json"
AUTOTUNE_SUFFIX = ".autotune.json"
GROUP_PREFIX = "__grp__"
# Compiler stages a cache hit never reads (Triton's binary-only mode leaves them out too).
IR_SUFFIXES = frozenset({".ttir", ".ttgir", ".llir", ".ptx", ".amdgcn", ".source", ".mlir"})
CAP_BYTES = 15 << 20  # the device returns files of at most 16 MiB


def cache_key(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """What a compiled cache is only valid for: the GPU's name (nvidia-smi; "cpu" without one)
    and the Triton and torch versions (package metadata: nothing is imported)."""
    del env  # the key reads the host, not the steps' environment
    gpu = "cpu"
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=False, timeout=30)
        names = done.stdout.strip().splitlines() if done.returncode == 0 else []
        gpu = names[0].strip() if names else "unknown"
    return {"gpu": gpu, "triton": _version("triton"), "torch": _version("torch")}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _safe(name: str) -> bool:
    """A member path that stays inside the cache."""
    path = Path(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _kept(path: Path) -> bool:
    return path.suffix not in IR_SUFFIXES


def _relative_group(group: Path, cache: Path) -> bytes | None:
    """A kernel's group file with its kept children as paths relative to the cache (None when
    it cannot be read: the kernel is left out rather than restored broken)."""
    try:
        children = json.loads(group.read_text())["child_paths"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    kept: dict[str, str] = {}
    for name, child in children.items():
        child_path = Path(child)
        if not _kept(child_path):
            continue
        try:
            kept[name] = str(child_path.resolve().relative_to(cache.resolve()))
        except ValueError:
            return None  # outside the cache: not portable
    return json.dumps({"child_paths": kept}).encode()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def archive_cache(cache: Path, archive: Path, key: Mapping[str, Any],
                  cap_bytes: int = CAP_BYTES) -> dict[str, Any]:
    """Write the cache to `archive` (gzip tar): the manifest, every autotune result, then each
    kernel's folder, newest first, while the compressed archive stays under `cap_bytes`.
    Returns the manifest (with `complete` false when kernels were left out)."""
    folders = sorted((p for p in cache.iterdir() if p.is_dir()),
                     key=lambda p: p.stat().st_mtime, reverse=True) if cache.is_dir() else []
    autotune = [p for folder in folders for p in sorted(folder.glob(f"*{AUTOTUNE_SUFFIX}"))]
    temporary = archive.with_name(archive.name + ".tmp")
    added, left_out = 0, 0
    with temporary.open("wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for path in autotune:
            tar.add(path, arcname=str(path.relative_to(cache)))
        for folder in folders:
            files = [p for p in sorted(folder.iterdir())
                     if p.is_file() and _kept(p) and not p.name.endswith(AUTOTUNE_SUFFIX)]
            if not files:
                continue
            if raw.tell() > cap_bytes:
                left_out += 1
                continue
            for path in files:
                name = str(path.relative_to(cache))
                if path.name.startswith(GROUP_PREFIX):
                    data = _relative_group(path, cache)
                    if data is not None:
                        _add_bytes(tar, name, data)
                else:
                    tar.add(path, arcname=name)
            added += 1
        manifest = {"key": dict(key), "autotune_results": len(autotune), "kernel_folders": added,
                    "left_out": left_out, "complete": left_out == 0}
        _add_bytes(tar, MANIFEST, json.dumps(manifest, indent=1).encode())
    temporary.replace(archive)
    return manifest


def find_seed(folders: Sequence[Path]) -> Path | None:
    """The archive to seed from: the first folder's `kernel-cache.tar.gz`, else its
    `triton-autotune.tar` (the first sitting's kind), else the next folder's."""
    for folder in folders:
        for name in (ARCHIVE, LEGACY_ARCHIVE):
            if (folder / name).is_file():
                return folder / name
    return None


def seed_cache(cache: Path, archive: Path | None, key: Mapping[str, Any]) -> dict[str, Any]:
    """Unpack `archive` into the cache (never over a file already there), its kernels' group
    files pointed at the new cache; nothing when its key differs from `key` (another GPU,
    Triton or torch). A keyless legacy archive seeds its autotune results only. Returns what
    was done: `seeded` files, and `skipped` with the reason when nothing was."""
    if archive is None or not archive.is_file():
        return {"archive": None, "seeded": 0, "skipped": "no archive to seed from"}
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile() and _safe(m.name)}
        built_for = None
        if MANIFEST in members:
            source = tar.extractfile(members[MANIFEST])
            built_for = json.loads(source.read()).get("key") if source else None
            if built_for != dict(key):
                return {"archive": archive.name, "seeded": 0,
                        "skipped": f"built for {built_for}, this host is {dict(key)}"}
        count = 0
        for name, member in members.items():
            if name == MANIFEST or (built_for is None and not name.endswith(AUTOTUNE_SUFFIX)):
                continue
            target = cache / name
            source = tar.extractfile(member)
            if target.exists() or source is None:
                continue
            data = source.read()
            if Path(name).name.startswith(GROUP_PREFIX):
                children = json.loads(data)["child_paths"]
                data = json.dumps({"child_paths": {
                    child: str(cache / path) for child, path in children.items()}}).encode()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            count += 1
    return {"archive": archive.name, "seeded": count, "skipped": None, "key": built_for}

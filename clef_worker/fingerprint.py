"""The weights fingerprint a worker reports in `ready`: a digest of its snapshot's files.

Why: the front keeps answers for repeats, and an answer is a function of the request *and* the
weights. The snapshot's path says nothing when its files are replaced in place (a rollout that
rewrites the directory, an operator copying a new snapshot over the old one) and the worker
restarts; the digest of what is there does. It covers every regular file under the snapshot
(its path relative to the root, its size, its bytes; not the bytecode a load may cache under
`__pycache__`), following symbolic links to files and directories, so any change of weights,
config or tokenizer changes it, also one made through a link.

Three costs and one race shape how it is computed:

- **Time.** Hashing page-cached files ran at 2 GiB/s on the 2-core development machine
  (docs/benchmarks.md, "Weights fingerprint"): Clef-Flash's ~18 GB of bf16 weights would take
  ~9 s there. So it runs on helper threads while the worker warms up (hashlib releases the GIL),
  and costs start-up time only where hashing outlasts warm-up.
- **Restarts.** A worker replaced after a crash or a stall would read every byte again. So each
  file's digest is kept between starts (`DigestCache`, a small JSON file in the service's cache
  directory) under the file's identity as `stat` gives it: device, inode, size, and the
  modification and change times in nanoseconds. Any write changes the change time (which no
  tool can set back, unlike the modification time `cp -p` or `touch -d` restore) and a
  replacement is another inode, so a kept digest is used only for the bytes it was taken from.
  Timestamps tick coarsely (a few milliseconds on Linux), so a file changed less than
  `SETTLED_S` before it was hashed is not kept: a second write within the same tick could
  leave its stat unchanged (git's "racily clean" entries, the same rule).
- **The race.** Files replaced while the worker loads them would give a fingerprint of other
  bytes than the loaded weights, and a later start with those files would keep serving the old
  weights' answers. So the files' identities are taken before the executor reads anything
  (`SnapshotWatch`) and again after hashing; if any differs, the start fails
  (`SnapshotChanged`, a StartupError naming the files) and the front starts a fresh worker,
  which loads and hashes the settled files. (What the stat cannot show is a second write
  within the same clock tick as a write just before the watch began.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from clef_worker.errors import StartupError

log = logging.getLogger("clef_worker.fingerprint")

# Files hashed at once: reads of different files overlap, and each digest runs on its own core.
HASH_THREADS = 4
# A file changed less than this before it was hashed is hashed again next time (see above).
SETTLED_S = 2.0
# The kept digests' file in the service's cache directory, and the most files it remembers.
DIGESTS_FILE = "snapshot-digests.json"
MAX_KEPT_FILES = 4096
_FORMAT = 1

# A file's identity: st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns.
Stat = tuple[int, int, int, int, int]


class SnapshotChanged(StartupError):
    """The snapshot's files changed between the executor's load and the end of hashing."""


def _stat_of(path: Path) -> Stat:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


# Derived files a load may write into the snapshot (importing the release's own module caches
# its bytecode beside it): not weights, and written during the load the watch spans.
DERIVED_DIRS = frozenset({"__pycache__"})


def list_files(root: Path) -> dict[str, Stat]:
    """Every regular file under `root` by its path relative to the root, with its identity
    (none under a DERIVED_DIRS directory).

    Symbolic links are followed, to files and to directories alike: a checkpoint's `adapter/`
    or a snapshot's subdirectory may be a link to where the files really are, and replacing
    them there changes the weights as surely as replacing them here (`Path.rglob` does not
    descend into linked directories, which is why this walks with `os.walk`). The names are
    the link's, under the root; a link that leads back to a directory it is already inside is
    not walked again (a loop), and a link to nothing is skipped like any non-file."""
    files = {}
    for directory, subdirs, names in os.walk(root, followlinks=True):
        here = Path(directory)
        relative_dir = here.relative_to(root)
        if not DERIVED_DIRS.isdisjoint(relative_dir.parts):
            subdirs[:] = []
            continue
        above = _identities_above(root, relative_dir)
        subdirs[:] = [name for name in subdirs if _dir_identity(here / name) not in above]
        for name in names:
            path = here / name
            if path.is_file():
                files[(relative_dir / name).as_posix()] = _stat_of(path)
    return dict(sorted(files.items()))


def _dir_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _identities_above(root: Path, relative_dir: Path) -> set[tuple[int, int] | None]:
    """The identities of the directories from `root` down to `relative_dir`, itself included:
    a linked subdirectory with one of them would walk in a loop."""
    identities = {_dir_identity(root)}
    current = root
    for part in relative_dir.parts:
        current = current / part
        identities.add(_dir_identity(current))
    return identities


def _stat_from(values: list[object]) -> Stat:
    if len(values) != 5 or not all(isinstance(value, int) for value in values):
        raise ValueError(f"not a file identity: {values!r}")
    dev, ino, size, mtime_ns, ctime_ns = (int(str(value)) for value in values)
    return (dev, ino, size, mtime_ns, ctime_ns)


def _changed_at(stat: Stat) -> float:
    """When the file last changed (its modification or change time, the later), in seconds."""
    return max(stat[3], stat[4]) / 1e9


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def default_digests_path() -> Path:
    """The kept digests' file, in the service's cache directory (clef_worker.demo.cache)."""
    from clef_worker.demo.cache import default_cache_root

    return default_cache_root() / DIGESTS_FILE


class DigestCache:
    """Per-file SHA-256 digests kept between worker starts, by absolute path and identity.

    Losing it only costs a re-hash: an unreadable or malformed file reads as empty, and a save
    that fails (a read-only home, a full disk) is logged and ignored. Two workers saving at once
    each replace the file whole (written beside it, renamed over it); the last one wins.
    """

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._kept: dict[str, tuple[Stat, str]] = self._read()
        self.hits = 0

    def _read(self) -> dict[str, tuple[Stat, str]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("format") != _FORMAT:
                return {}
            return {str(name): (_stat_from(entry[:5]), str(entry[5]))
                    for name, entry in data["files"].items()}
        except (OSError, ValueError, AttributeError, KeyError, TypeError, IndexError):
            return {}

    def get(self, path: Path, stat: Stat) -> bytes | None:
        entry = self._kept.get(str(path))
        if entry is None or entry[0] != stat:
            return None
        try:
            digest = bytes.fromhex(entry[1])
        except ValueError:
            return None
        self.hits += 1
        return digest

    def put(self, path: Path, stat: Stat, digest: bytes) -> None:
        """Keep a digest, unless the file changed too recently for its stat to be trusted."""
        if self._clock() - _changed_at(stat) < SETTLED_S:
            self._kept.pop(str(path), None)
            return
        self._kept[str(path)] = (stat, digest.hex())

    def save(self) -> None:
        """Write the kept digests of files that still exist (the most recently changed
        MAX_KEPT_FILES of them)."""
        if self.path is None:
            return
        names = [name for name in self._kept if os.path.exists(name)]
        names.sort(key=lambda name: _changed_at(self._kept[name][0]), reverse=True)
        kept = {name: [*self._kept[name][0], self._kept[name][1]]
                for name in names[:MAX_KEPT_FILES]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".digests-")
        except OSError as exc:
            log.info("cannot keep the snapshot's file digests in %s (%s): the next start "
                     "hashes every file again", self.path, exc)
            return
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                json.dump({"format": _FORMAT, "files": kept}, out)
            os.replace(temporary, self.path)
        except OSError as exc:
            log.info("cannot keep the snapshot's file digests in %s (%s): the next start "
                     "hashes every file again", self.path, exc)
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def combine(files: Mapping[str, Stat], digests: Mapping[str, bytes]) -> str:
    """The snapshot's fingerprint from its files' names, sizes and digests, in name order."""
    total = hashlib.sha256()
    for name in sorted(files):
        encoded = name.encode("utf-8", "surrogateescape")
        total.update(len(encoded).to_bytes(4, "big") + encoded)
        total.update(files[name][2].to_bytes(8, "big") + digests[name])
    return total.hexdigest()


class SnapshotWatch:
    """The snapshot's files as they were before the executor read them; `fingerprint` hashes
    them and trusts the result only if every file is still the one the watch saw.

    `only` restricts the watch to those files (paths relative to the root): a fine-tuned
    variant's checkpoint is its adapter and head files, not the optimizer state beside them."""

    def __init__(self, root: Path | None, cache: DigestCache | None = None,
                 only: frozenset[str] | None = None) -> None:
        self.root = root if root is not None and root.is_dir() else None
        self.only = only
        self.before = self._files() if self.root is not None else {}
        self.cache = cache if cache is not None else DigestCache(None)

    def _files(self) -> dict[str, Stat]:
        assert self.root is not None
        files = list_files(self.root)
        if self.only is None:
            return files
        return {name: stat for name, stat in files.items() if name in self.only}

    def fingerprint(self) -> str:
        """The hex digest of the snapshot's files, or "" without a snapshot directory; raises
        SnapshotChanged when a file was added, removed or changed since the watch began."""
        root = self.root
        if root is None:
            return ""
        kept: dict[str, bytes] = {}
        for name, stat in self.before.items():
            digest = self.cache.get(root / name, stat)
            if digest is not None:
                kept[name] = digest
        todo = [name for name in self.before if name not in kept]
        try:
            with ThreadPoolExecutor(HASH_THREADS) as pool:
                fresh = dict(zip(todo, pool.map(lambda name: _file_digest(root / name), todo),
                                 strict=True))
        except FileNotFoundError:
            fresh = {}  # removed since the watch began: reported below
        after = self._files()
        if after != self.before:
            changed = sorted(name for name in {*after, *self.before}
                             if after.get(name) != self.before.get(name))
            raise SnapshotChanged(
                f"the files at {root} changed while the worker loaded them "
                f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}); its weights "
                "and its fingerprint could differ, so it stops and a fresh worker loads the "
                "settled files")
        for name, digest in fresh.items():
            self.cache.put(root / name, self.before[name], digest)
        if fresh:
            self.cache.save()
        digests = {**kept, **fresh}
        return combine(self.before, digests)

    def start(self) -> Future[str]:
        """`fingerprint`, computed on a thread of its own while the worker warms up."""
        runner = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
        future = runner.submit(self.fingerprint)
        runner.shutdown(wait=False)
        return future


# What a fine-tuned variant's weights are, inside its checkpoint (clef_worker.variants reads
# these and nothing else: the optimizer's state beside them is never opened).
VARIANT_FILES = frozenset({"adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                           "joint_head.safetensors"})


def variant_fingerprint(base: str, files: str) -> str:
    """A variant's fingerprint: its answers depend on the base's weights and on its own adapter
    and head files, so it changes when either does."""
    return hashlib.sha256(f"variant\0{base}\0{files}".encode()).hexdigest()


class ModelsWatch:
    """The base snapshot's watch and each fine-tuned variant's (its adapter and head files):
    every served model's fingerprint, computed one watch after the other on one helper thread
    (they share one `DigestCache`, which is not safe to use from two threads at once)."""

    def __init__(self, base: SnapshotWatch, variants: Mapping[str, SnapshotWatch]) -> None:
        self.base = base
        self.variants = dict(variants)

    def fingerprints(self) -> tuple[str, dict[str, str]]:
        """The base's fingerprint, and each variant's by name (`variant_fingerprint`); raises
        SnapshotChanged as `SnapshotWatch.fingerprint` does."""
        base = self.base.fingerprint()
        return base, {name: variant_fingerprint(base, watch.fingerprint())
                      for name, watch in self.variants.items()}

    def start(self) -> Future[tuple[str, dict[str, str]]]:
        """`fingerprints`, computed on a thread of its own while the worker warms up."""
        runner = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
        future = runner.submit(self.fingerprints)
        runner.shutdown(wait=False)
        return future


def snapshot_fingerprint(root: Path) -> str:
    """The fingerprint of the files under `root` now, with no kept digests (tools, tests)."""
    return SnapshotWatch(root).fingerprint()

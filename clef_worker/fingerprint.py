"""The weights fingerprint a worker reports in `ready`: a digest of its snapshot's files.

Why: the front keeps answers for repeats, and an answer is a function of the request *and* the
weights. The snapshot's path says nothing when its files are replaced in place (a rollout that
rewrites the directory, an operator copying a new snapshot over the old one) and the worker
restarts; the digest of what is there does. It covers every regular file under the snapshot
(its path relative to the root, its size, its bytes), so any change of weights, config or
tokenizer changes it.

It is computed on helper threads while the worker warms up (hashlib releases the GIL while it
digests), so on a large snapshot it costs start-up time only where hashing outlasts warm-up.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# Files hashed at once: reads of different files overlap, and each digest runs on its own core.
HASH_THREADS = 4


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def snapshot_fingerprint(root: Path) -> str:
    """The hex digest of every regular file under `root` (names, sizes, contents), or "" when
    `root` is not a directory (an executor with no snapshot on disk)."""
    if not root.is_dir():
        return ""
    files = sorted(path for path in root.rglob("*") if path.is_file())
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        digests = list(pool.map(_file_digest, files))
    total = hashlib.sha256()
    for path, digest in zip(files, digests, strict=True):
        name = path.relative_to(root).as_posix().encode("utf-8", "surrogateescape")
        total.update(len(name).to_bytes(4, "big") + name)
        total.update(path.stat().st_size.to_bytes(8, "big") + digest)
    return total.hexdigest()


def start_fingerprint(snapshot: str) -> Future[str]:
    """`snapshot_fingerprint` of the snapshot at `snapshot`, computed on a thread of its own."""
    runner = ThreadPoolExecutor(1, thread_name_prefix="fingerprint")
    future = runner.submit(snapshot_fingerprint, Path(snapshot)) if snapshot else None
    runner.shutdown(wait=False)
    if future is None:
        done: Future[str] = Future()
        done.set_result("")
        return done
    return future

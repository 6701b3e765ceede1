"""What the weights fingerprint costs a worker start: the first start hashes every file, a
restart reads the digests kept from the last one (clef_worker.fingerprint).

Not a test. Writes `--gib` GiB of random bytes in `--files` files to a temporary directory
(a snapshot's safetensors shards stand-in; Clef-Flash's bf16 weights are ~18 GB), reads them
once so both rows see a page-cached snapshot, then times, best of `--rounds`:

- `first start`: `SnapshotWatch(...).fingerprint()` with no kept digests (every byte hashed);
- `restart`: the same with the digests the previous start kept (only stat calls).

    python bench/bench_fingerprint.py             # 4 GiB in 4 files
    python bench/bench_fingerprint.py --gib 1     # quicker
    python bench/bench_fingerprint.py --quick     # CI smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout (bench/README.md)

from clef_worker.fingerprint import SETTLED_S, DigestCache, SnapshotWatch

CHUNK = 64 << 20


def _write(root: Path, gib: float, files: int) -> None:
    per_file = int(gib * (1 << 30)) // files
    for index in range(files):
        with (root / f"model-{index + 1:05d}-of-{files:05d}.safetensors").open("wb") as out:
            left = per_file
            while left > 0:
                out.write(os.urandom(min(CHUNK, left)))
                left -= CHUNK


def _read_all(root: Path) -> None:
    for path in root.iterdir():
        with path.open("rb") as handle:
            while handle.read(CHUNK):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 64 MiB, one round")
    args = parser.parse_args()
    if args.quick:
        args.gib, args.files, args.rounds = 1 / 16, 2, 1
    with tempfile.TemporaryDirectory(prefix="clef-fingerprint-") as scratch:
        root = Path(scratch) / "snapshot"
        root.mkdir()
        _write(root, args.gib, args.files)
        _read_all(root)
        kept = Path(scratch) / "digests.json"

        def later() -> float:  # the files were written moments ago; a real restart is later
            return time.time() + 10 * SETTLED_S

        first, restart = [], []
        for _ in range(args.rounds):
            kept.unlink(missing_ok=True)
            started = time.perf_counter()
            SnapshotWatch(root, DigestCache(kept, clock=later)).fingerprint()
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            cache = DigestCache(kept, clock=later)
            SnapshotWatch(root, cache).fingerprint()
            restart.append(time.perf_counter() - started)
            assert cache.hits == args.files, cache.hits
    best_first, best_restart = min(first), min(restart)
    print(json.dumps({
        "gib": args.gib, "files": args.files, "rounds": args.rounds, "cpus": os.cpu_count(),
        "first_start_s": round(best_first, 3),
        "first_start_gib_per_s": round(args.gib / best_first, 2),
        "restart_ms": round(best_restart * 1000, 2),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

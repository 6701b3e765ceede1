"""The kernel cache a GPU sitting leaves and the next one seeds from
(benchlib/kernel_cache_archive.py), on a cache laid out as Triton lays it out, without a GPU."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from benchlib.kernel_cache_archive import (
    ARCHIVE,
    LEGACY_ARCHIVE,
    MANIFEST,
    archive_cache,
    cache_key,
    find_seed,
    seed_cache,
)

KEY = {"gpu": "NVIDIA H200", "triton": "3.6.0", "torch": "2.11.0+cu130"}


def triton_kernel(cache: Path, folder: str, name: str, binary: bytes) -> None:
    """One compiled kernel as Triton's file cache keeps it: its stages, its metadata, and the
    group file naming them by absolute path."""
    where = cache / folder
    where.mkdir(parents=True)
    children = {}
    for suffix, data in ((".cubin", binary), (".json", b'{"name": "k"}'),
                         (".ptx", b"ptx text"), (".ttir", b"ir"), (".llir", b"ll")):
        path = where / f"{name}{suffix}"
        path.write_bytes(data)
        children[f"{name}{suffix}"] = str(path)
    (where / f"__grp__{name}.json").write_text(json.dumps({"child_paths": children}))


def test_the_archive_keeps_what_a_cache_hit_reads_and_seeds_another_location(
        tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    triton_kernel(cache, "AAA", "chunk_fwd", b"\x7fcubin-a")
    (cache / "BBB").mkdir()
    (cache / "BBB" / "chunk_fwd.autotune.json").write_text('{"BT": 64}')
    (cache / "CCC").mkdir()
    (cache / "CCC" / "cuda_utils.so").write_bytes(b"\x7fELF")  # Triton's launcher module
    archive = tmp_path / ARCHIVE
    manifest = archive_cache(cache, archive, KEY)
    assert manifest["complete"] and manifest["key"] == KEY
    assert manifest["autotune_results"] == 1
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        group = json.loads(tar.extractfile("AAA/__grp__chunk_fwd.json").read())  # type: ignore[union-attr]
    assert names == {MANIFEST, "AAA/chunk_fwd.cubin", "AAA/chunk_fwd.json",
                     "AAA/__grp__chunk_fwd.json", "BBB/chunk_fwd.autotune.json",
                     "CCC/cuda_utils.so"}  # the IR text is left out
    assert group == {"child_paths": {"chunk_fwd.cubin": "AAA/chunk_fwd.cubin",
                                     "chunk_fwd.json": "AAA/chunk_fwd.json"}}
    # the next sitting, its cache elsewhere: every group names files that exist there
    fresh = tmp_path / "elsewhere" / "cache"
    report = seed_cache(fresh, archive, KEY)
    assert report["seeded"] == 5 and report["skipped"] is None
    restored = json.loads((fresh / "AAA" / "__grp__chunk_fwd.json").read_text())["child_paths"]
    assert restored == {"chunk_fwd.cubin": str(fresh / "AAA" / "chunk_fwd.cubin"),
                        "chunk_fwd.json": str(fresh / "AAA" / "chunk_fwd.json")}
    assert all(Path(path).is_file() for path in restored.values())
    assert (fresh / "AAA" / "chunk_fwd.cubin").read_bytes() == b"\x7fcubin-a"
    assert seed_cache(fresh, archive, KEY)["seeded"] == 0  # never over what is there


def test_a_cache_built_for_another_gpu_or_triton_seeds_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    triton_kernel(cache, "AAA", "k", b"bin")
    archive = tmp_path / ARCHIVE
    archive_cache(cache, archive, KEY)
    for other in ({**KEY, "gpu": "NVIDIA H100"}, {**KEY, "triton": "3.7.0"}):
        report = seed_cache(tmp_path / "fresh", archive, other)
        assert report["seeded"] == 0 and "built for" in report["skipped"]
    assert not (tmp_path / "fresh" / "AAA").exists()


def test_the_first_sittings_autotune_archive_still_seeds_its_results(tmp_path: Path) -> None:
    legacy = tmp_path / LEGACY_ARCHIVE
    payload = tmp_path / "payload"
    payload.write_text('{"BT": 32}')
    with tarfile.open(legacy, "w") as tar:
        tar.add(payload, arcname="XYZ/kernel.autotune.json")
        tar.add(payload, arcname="../escape.autotune.json")  # outside the cache: never
        tar.add(payload, arcname="XYZ/kernel.cubin")  # not an autotune result: not trusted
    fresh = tmp_path / "fresh"
    assert seed_cache(fresh, legacy, KEY)["seeded"] == 1
    assert (fresh / "XYZ" / "kernel.autotune.json").read_text() == '{"BT": 32}'
    assert not (fresh / "XYZ" / "kernel.cubin").exists()
    assert not (tmp_path / "escape.autotune.json").exists()
    assert seed_cache(fresh, None, KEY)["skipped"] == "no archive to seed from"


def test_the_newest_kind_of_archive_is_preferred(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    assert find_seed([first, second]) is None
    (second / LEGACY_ARCHIVE).write_bytes(b"")
    assert find_seed([first, second]) == second / LEGACY_ARCHIVE
    (second / ARCHIVE).write_bytes(b"")
    assert find_seed([first, second]) == second / ARCHIVE


def test_past_the_size_cap_the_oldest_kernels_are_left_out_and_said_so(tmp_path: Path) -> None:
    import os
    import random

    cache = tmp_path / "cache"
    noise = random.Random(0)
    for index in range(4):
        triton_kernel(cache, f"K{index}", "k", noise.randbytes(64 << 10))  # incompressible
        os.utime(cache / f"K{index}", (1000 + index, 1000 + index))
    manifest = archive_cache(cache, tmp_path / ARCHIVE, KEY, cap_bytes=100 << 10)
    assert not manifest["complete"] and manifest["left_out"] >= 1
    assert manifest["kernel_folders"] + manifest["left_out"] == 4
    with tarfile.open(tmp_path / ARCHIVE) as tar:
        folders = {name.split("/")[0] for name in tar.getnames() if "/" in name}
    assert "K3" in folders and "K0" not in folders  # the newest kept


def test_the_key_names_the_host_without_importing_torch() -> None:
    key = cache_key()
    assert set(key) == {"gpu", "triton", "torch"}
    assert key["gpu"]  # "cpu" on a host without nvidia-smi

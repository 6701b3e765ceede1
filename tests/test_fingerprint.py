"""The weights fingerprint (clef_worker.fingerprint): what it covers (a variant's included), the
digests it keeps between starts and when it refuses to use them, and the files changing under a
load."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from clef_worker import fingerprint
from clef_worker.fingerprint import (
    VARIANT_FILES,
    DigestCache,
    ModelsWatch,
    SnapshotChanged,
    SnapshotWatch,
    snapshot_fingerprint,
)


def _snapshot(root: Path) -> Path:
    (root / "tokenizer").mkdir(parents=True)
    (root / "model.safetensors").write_bytes(b"\x01" * 4096)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
    return root


class CountingDigests:
    """Counts the files hashed (clef_worker.fingerprint._file_digest), still hashing them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read: list[str] = []
        real = fingerprint._file_digest

        def counting(path: Path) -> bytes:
            self.read.append(path.name)
            return real(path)

        monkeypatch.setattr(fingerprint, "_file_digest", counting)


def _rewrite_on_a_later_tick(path: Path, data: bytes) -> None:
    """Write `data` over `path` until its change time has moved: file times tick coarsely, and
    these tests are about a write the stat can see (one within the same tick it cannot)."""
    before = path.stat().st_ctime_ns
    path.write_bytes(data)
    while path.stat().st_ctime_ns == before:
        path.write_bytes(data)


def _later() -> float:
    """A clock past the settling time of every file the test wrote."""
    return time.time() + 10 * fingerprint.SETTLED_S


def test_it_covers_names_and_bytes_and_skips_derived_bytecode(tmp_path: Path) -> None:
    root = _snapshot(tmp_path / "a")
    first = snapshot_fingerprint(root)
    assert len(first) == 64 and snapshot_fingerprint(root) == first
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "release.cpython-311.pyc").write_bytes(b"bytecode")
    assert snapshot_fingerprint(root) == first  # a load's bytecode cache is not weights
    (root / "config.json").rename(root / "config2.json")
    assert snapshot_fingerprint(root) != first
    (root / "config2.json").rename(root / "config.json")
    assert snapshot_fingerprint(root) == first
    (root / "tokenizer" / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    assert snapshot_fingerprint(root) != first
    assert snapshot_fingerprint(tmp_path / "missing") == ""


def test_a_restart_reads_no_settled_file_again(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    root = _snapshot(tmp_path / "snap")
    counting = CountingDigests(monkeypatch)
    kept = tmp_path / "cache" / "digests.json"
    first = SnapshotWatch(root, DigestCache(kept, clock=_later)).fingerprint()
    assert sorted(counting.read) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert kept.is_file()
    counting.read.clear()
    cache = DigestCache(kept, clock=_later)
    assert SnapshotWatch(root, cache).fingerprint() == first
    assert counting.read == [] and cache.hits == 3
    assert first == snapshot_fingerprint(root)  # the same value as hashing everything


def test_files_changed_moments_ago_are_hashed_every_time(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the settling time a file's stat may not tell two writes apart: not kept."""
    root = _snapshot(tmp_path / "snap")
    counting = CountingDigests(monkeypatch)
    kept = tmp_path / "digests.json"
    SnapshotWatch(root, DigestCache(kept, clock=time.time)).fingerprint()
    counting.read.clear()
    SnapshotWatch(root, DigestCache(kept, clock=time.time)).fingerprint()
    assert len(counting.read) == 3


def test_bytes_replaced_with_the_old_size_and_modification_time_are_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cp -p` of a same-sized file over a kept one restores its modification time; the change
    time still moves, so the kept digest is not used."""
    root = _snapshot(tmp_path / "snap")
    kept = tmp_path / "digests.json"
    before = SnapshotWatch(root, DigestCache(kept, clock=_later)).fingerprint()
    weights = root / "model.safetensors"
    old = weights.stat()
    _rewrite_on_a_later_tick(weights, b"\x02" * 4096)
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert weights.stat().st_mtime_ns == old.st_mtime_ns and weights.stat().st_size == old.st_size
    counting = CountingDigests(monkeypatch)
    after = SnapshotWatch(root, DigestCache(kept, clock=_later)).fingerprint()
    assert counting.read == ["model.safetensors"]
    assert after != before and after == snapshot_fingerprint(root)


@pytest.mark.parametrize("change", ["rewrite", "add", "remove"])
def test_files_changed_under_the_load_fail_the_start(tmp_path: Path, change: str) -> None:
    """The watch is taken before the executor reads the files; a change before the hashing
    ends means the weights loaded and the fingerprint may be of different bytes."""
    root = _snapshot(tmp_path / "snap")
    watch = SnapshotWatch(root)
    if change == "rewrite":  # the same size: only the change time tells
        _rewrite_on_a_later_tick(root / "model.safetensors", b"\x03" * 4096)
    elif change == "add":
        (root / "extra.safetensors").write_bytes(b"\x00")
    else:
        (root / "config.json").unlink()
    with pytest.raises(SnapshotChanged, match=r"changed while the worker loaded them"):
        watch.fingerprint()


def test_a_lost_or_unwritable_digest_file_costs_only_a_rehash(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _snapshot(tmp_path / "snap")
    expected = snapshot_fingerprint(root)
    garbled = tmp_path / "digests.json"
    garbled.write_text('{"format": 1, "files": {"x": [1, 2]}')
    assert SnapshotWatch(root, DigestCache(garbled, clock=_later)).fingerprint() == expected
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    unwritable = DigestCache(blocker / "digests.json", clock=_later)
    assert SnapshotWatch(root, unwritable).fingerprint() == expected
    counting = CountingDigests(monkeypatch)
    assert SnapshotWatch(root, DigestCache(blocker / "digests.json")).fingerprint() == expected
    assert len(counting.read) == 3


def _checkpoint(root: Path) -> Path:
    (root / "adapter").mkdir(parents=True)
    (root / "adapter" / "adapter_config.json").write_text('{"r": 4}')
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"\x02" * 512)
    (root / "joint_head.safetensors").write_bytes(b"\x03" * 256)
    (root / "training_state.pt").write_bytes(b"optimizer")
    return root


def _models(base: Path, checkpoint: Path) -> tuple[str, dict[str, str]]:
    cache = DigestCache(None)
    return ModelsWatch(SnapshotWatch(base, cache), {"tuned": SnapshotWatch(
        checkpoint, cache, only=VARIANT_FILES)}).fingerprints()


def test_a_variants_fingerprint_covers_the_base_and_its_adapter_and_head(tmp_path: Path) -> None:
    base, checkpoint = _snapshot(tmp_path / "base"), _checkpoint(tmp_path / "tuned")
    base_print, variants = _models(base, checkpoint)
    assert base_print == snapshot_fingerprint(base)
    first = variants["tuned"]
    assert first != base_print
    # The optimizer state beside the weights is not part of them.
    (checkpoint / "training_state.pt").write_bytes(b"another optimizer")
    assert _models(base, checkpoint)[1]["tuned"] == first
    for name in VARIANT_FILES:  # each of its weight files is
        path = checkpoint / name
        kept = path.read_bytes()
        path.write_bytes(kept + b"\x00")
        assert _models(base, checkpoint)[1]["tuned"] != first, name
        path.write_bytes(kept)
    assert _models(base, checkpoint)[1]["tuned"] == first
    # And so are the base's weights: the same adapter over other weights answers otherwise.
    (base / "model.safetensors").write_bytes(b"\x04" * 4096)
    moved_base, moved = _models(base, checkpoint)
    assert moved_base != base_print and moved["tuned"] != first


def test_files_behind_a_symlinked_directory_are_covered(tmp_path: Path) -> None:
    """A checkpoint's `adapter/` and a snapshot's subdirectory may be links to where the files
    live: files replaced through the link change the fingerprint (the walk follows links to
    directories, which `Path.rglob` does not), under the link's own name."""
    base = _snapshot(tmp_path / "base")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(base / "tokenizer"), str(elsewhere))
    (base / "tokenizer").symlink_to(elsewhere, target_is_directory=True)
    linked = snapshot_fingerprint(base)
    assert linked == snapshot_fingerprint(_snapshot(tmp_path / "plain"))  # names, not paths
    (elsewhere / "tokenizer.json").write_text('{"vocab": {"b": 1}}')
    assert snapshot_fingerprint(base) != linked

    checkpoint = _checkpoint(tmp_path / "tuned")
    adapters = tmp_path / "adapters"
    shutil.move(str(checkpoint / "adapter"), str(adapters))
    (checkpoint / "adapter").symlink_to(adapters, target_is_directory=True)
    first = _models(base, checkpoint)[1]["tuned"]
    assert first == _models(base, _checkpoint(tmp_path / "copy"))[1]["tuned"]
    (adapters / "adapter_model.safetensors").write_bytes(b"\x09" * 64)
    assert _models(base, checkpoint)[1]["tuned"] != first


def test_a_link_back_up_the_tree_is_not_walked_in_a_loop(tmp_path: Path) -> None:
    root = _snapshot(tmp_path / "a")
    first = snapshot_fingerprint(root)
    (root / "tokenizer" / "up").symlink_to(root, target_is_directory=True)
    (root / "dangling").symlink_to(tmp_path / "nothing")
    assert snapshot_fingerprint(root) == first

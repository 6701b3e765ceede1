"""A passing start-up self-check kept between worker starts (clef_worker.starting.verdict_store).

The end-to-end test runs a real front with the production defaults (self-check on) on a copy of
the tiny snapshot: a worker killed with SIGKILL is restarted by the front and keeps the verdict
(`/health` `worker.self_check.reused: true`); once a weights file is replaced in place with other
bytes, the next worker runs the check again and it passes. Each test has its own verdict
directory (tests/conftest.py), as each deployment has its own cache.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchlib.serve import Serve
from clef_protocol import messages
from clef_protocol.frames import read_frame_blocking
from clef_worker.assembly import assemble_snapshot
from clef_worker.main import parse_args, start
from clef_worker.starting import verdict_store
from clef_worker.starting.check_probes import PROBES
from clef_worker.starting.self_check import Probe, probe_small
from clef_worker.starting.verdict_store import VerdictStore, checked, verdict_key
from tests.doubles import break_suffix_positions

PASSED = messages.SelfCheck(True, "per-group", 13, 2e-7, [], mode="on", bound=1e-4, ms=900.0)


def _copy(tiny_snapshot: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "snapshot"
    shutil.copytree(tiny_snapshot, copy)
    return copy


def _perturb_weights(snapshot: Path) -> None:
    """Replace model.safetensors in place (same path) with slightly different weights."""
    path = snapshot / "model.safetensors"
    tensors = load_file(path)
    name = next(key for key, value in tensors.items() if value.is_floating_point())
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, path, metadata={"format": "pt"})


# -- the store ----------------------------------------------------------------------------


def test_a_passing_verdict_is_kept_under_its_key_only(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path / "verdicts")
    key: dict[str, Any] = {"format": 1, "weights": {"fingerprint": "a"}, "device": "cpu"}
    assert store.load(key) is None
    assert store.save(key, PASSED)
    assert store.load(key) == PASSED
    assert store.load({**key, "device": "NVIDIA H200"}) is None
    assert store.load({**key, "weights": {"fingerprint": "b"}}) is None
    assert [p.name for p in (tmp_path / "verdicts").iterdir()] == \
        [f"{verdict_store.key_digest(key)}.json"]  # no temporary file left behind


def test_failed_or_fallen_back_verdicts_are_never_kept(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path)
    key = {"weights": {"fingerprint": "a"}}
    assert not store.save(key, dataclasses.replace(PASSED, passed=False))
    assert not store.save(key, dataclasses.replace(PASSED, fell_back_from=["per-group"]))
    assert store.load(key) is None and list(tmp_path.iterdir()) == []
    assert not VerdictStore(None).save(key, PASSED)


@pytest.mark.parametrize("content", ["{not json", '{"format": 1}', '{"format": 99}',
                                     '{"format": 1, "key": {}, "verdict": {"passed": true}}'])
def test_an_unreadable_verdict_reads_as_absent(tmp_path: Path, content: str) -> None:
    store = VerdictStore(tmp_path)
    key = {"weights": {"fingerprint": "a"}}
    (tmp_path / f"{verdict_store.key_digest(key)}.json").write_text(content)
    assert store.load(key) is None


def test_the_oldest_verdicts_go_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verdict_store, "MAX_KEPT", 3)
    store = VerdictStore(tmp_path)
    for number in range(5):
        assert store.save({"n": number}, PASSED)
        os.utime(tmp_path / f"{verdict_store.key_digest({'n': number})}.json",
                 (1_000_000 + number, 1_000_000 + number))
    store.save({"n": 5}, PASSED)
    assert store.load({"n": 0}) is None and store.load({"n": 1}) is None
    assert store.load({"n": 5}) == PASSED and len(list(tmp_path.iterdir())) == 3


def test_the_directory_follows_the_operator(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import VERDICTS_ENV

    assert VERDICTS_ENV == verdict_store.DIRECTORY_ENV  # the tests isolate the real variable
    monkeypatch.setenv(verdict_store.DIRECTORY_ENV, str(tmp_path / "mine"))
    assert verdict_store.default_directory() == tmp_path / "mine"
    monkeypatch.delenv(verdict_store.DIRECTORY_ENV)
    monkeypatch.setenv("CLEF_SERVE_CACHE", str(tmp_path / "svc"))
    assert verdict_store.default_directory() == tmp_path / "svc" / "self-check"


# -- the key ------------------------------------------------------------------------------


def test_the_key_holds_what_the_answers_depend_on(tiny_snapshot: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    key = verdict_key(executor, "f" * 64, PROBES)
    assert key is not None
    assert key["weights"]["fingerprint"] == "f" * 64 and key["device"] == "cpu"
    assert key["dtype"] == "float32" and key["path"] == "per-group"
    assert key["check"]["probes"] == ["groups", "small", "prefix"]
    assert key["prefix_cache"] == {"block_tokens": 256, "capacity_bytes": 1 << 30}
    assert key["versions"]["torch"] == torch.__version__ and "triton" in key["versions"]
    assert len(key["code"]["source"]) == 64 and key["code"]["version"]
    assert key["policy"]["batch_layout"] == "per-group"
    assert verdict_key(executor, "", PROBES) is None  # no fingerprint: nothing is kept
    digest = verdict_store.key_digest(key)
    for changed in (verdict_key(executor, "e" * 64, PROBES),
                    verdict_key(executor, "f" * 64, PROBES, {"tiny-alpha": "a" * 64}),
                    verdict_key(executor, "f" * 64, (*PROBES, Probe("extra", probe_small)))):
        assert changed is not None and verdict_store.key_digest(changed) != digest
    padded = assemble_snapshot(tiny_snapshot, device="cpu", media="off", batch_layout="padded")
    other = verdict_key(padded, "f" * 64, PROBES)
    assert other is not None and verdict_store.key_digest(other) != digest
    # A verdict from a start with the prefix cache off never ran the `prefix` probe.
    uncached = assemble_snapshot(tiny_snapshot, device="cpu", media="off", prefix_cache="off")
    off = verdict_key(uncached, "f" * 64, PROBES)
    assert off is not None and off["prefix_cache"] is None
    assert verdict_store.key_digest(off) != digest


def test_the_key_holds_fla_and_triton_settings_and_the_cache_capacity(
        tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings that change the kernels built change the key; where the kernel cache lives does
    not (moving it to another volume keeps the verdict); another prefix-cache bound does."""
    for name in [n for n in os.environ if n.startswith(("FLA_", "TRITON_"))]:
        monkeypatch.delenv(name)
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    key = verdict_key(executor, "f" * 64, PROBES)
    assert key is not None and key["environment"] == {}
    digest = verdict_store.key_digest(key)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere/triton")
    moved = verdict_key(executor, "f" * 64, PROBES)
    assert moved is not None and verdict_store.key_digest(moved) == digest
    for name, value in (("FLA_USE_FAST_OPS", "1"), ("TRITON_F32_DEFAULT", "ieee")):
        monkeypatch.setenv(name, value)
        changed = verdict_key(executor, "f" * 64, PROBES)
        assert changed is not None and changed["environment"][name] == value
        assert verdict_store.key_digest(changed) != digest
        monkeypatch.delenv(name)
    smaller = assemble_snapshot(tiny_snapshot, device="cpu", media="off",
                                prefix_cache_bytes=1 << 20)
    bounded = verdict_key(smaller, "f" * 64, PROBES)
    assert bounded is not None and bounded["prefix_cache"]["capacity_bytes"] == 1 << 20
    assert verdict_store.key_digest(bounded) != digest


def test_the_source_digest_changes_with_a_source_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "clefprobepkg"
    package.mkdir()
    (package / "__init__.py").write_text("A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = verdict_store.source_digest(("clefprobepkg",))
    (package / "__init__.py").write_text("A = 2\n")
    assert verdict_store.source_digest(("clefprobepkg",)) != before


# -- in-process starts ----------------------------------------------------------------------


def _start(snapshot: Path, *flags: str) -> dict:
    channel = io.BytesIO()
    executor = start(parse_args(["--model", str(snapshot), "--device", "cpu", *flags]), channel)
    channel.seek(0)
    frame = read_frame_blocking(channel)
    assert executor is not None and frame is not None and frame["kind"] == messages.READY
    return frame


def test_report_and_off_never_read_nor_write(tiny_snapshot: Path, tmp_path: Path) -> None:
    snapshot = _copy(tiny_snapshot, tmp_path)
    for mode in ("report", "off"):
        frame = _start(snapshot, "--self-check", mode)
        assert frame["self_check"] is None if mode == "off" else not frame["self_check"]["reused"]
    assert not verdict_store.default_directory().exists() or \
        list(verdict_store.default_directory().iterdir()) == []
    first = _start(snapshot)
    assert first["self_check"]["reused"] is False and first["self_check"]["passed"]
    again = _start(snapshot, "--self-check", "report")
    assert again["self_check"]["reused"] is False  # a benchmark's start measures its check


def test_checked_waits_for_the_fingerprint_and_reuses(tiny_snapshot: Path,
                                                      tmp_path: Path) -> None:
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    executor.warm_up()
    store = VerdictStore(tmp_path)
    asked: list[str] = []

    def fingerprint() -> str:
        asked.append("yes")
        return "a" * 64

    first = checked(executor, "on", fingerprint, store)
    second = checked(executor, "strict", fingerprint, store)
    assert first is not None and second is not None and asked == ["yes", "yes"]
    assert not first.reused and second.reused and second.mode == "strict"
    assert second.probes == first.probes and second.max_abs_diff == first.max_abs_diff
    assert second.ms < first.ms
    unknown = checked(executor, "on", lambda: "", store)  # no fingerprint: checked, not kept
    assert unknown is not None and not unknown.reused


def test_the_prefix_probe_is_kept_with_the_verdict_unless_it_turned_the_cache_off(
        tiny_snapshot: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `prefix` probe is part of the kept verdict: a restart on the same key skips it with
    the rest and the cache stays on. A start where it disagreed turned the cache off (`on`'s
    remedy); that verdict is not kept, so the next start probes again (a kept one would skip
    the probe and serve the faulty cache)."""
    from clef_worker.serving.prefix import run as prefix_run
    from clef_worker.starting.prefix_probe import PROBE_NAME

    store = VerdictStore(tmp_path)
    probed: list[int] = []
    original = prefix_run.prefixed_forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        probed.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_run, "prefixed_forward", counting)
    executor = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    first = checked(executor, "on", lambda: "b" * 64, store)
    assert first is not None and not first.reused and probed
    assert [p["passed"] for p in first.probes if p["name"] == PROBE_NAME] == [True]
    probed.clear()
    again = checked(assemble_snapshot(tiny_snapshot, device="cpu", media="off"), "on",
                    lambda: "b" * 64, store)
    assert again is not None and again.reused and not probed

    break_suffix_positions(monkeypatch)
    faulty = assemble_snapshot(tiny_snapshot, device="cpu", media="off")
    remedied = checked(faulty, "on", lambda: "c" * 64, store)
    assert remedied is not None and remedied.passed and not remedied.reused
    assert faulty.runner.prefix_cache is not None and not faulty.runner.prefix_cache.enabled
    assert not verdict_store.keepable(remedied)
    probed.clear()
    later = checked(assemble_snapshot(tiny_snapshot, device="cpu", media="off"), "on",
                    lambda: "c" * 64, store)
    assert later is not None and not later.reused and probed


# -- a real front --------------------------------------------------------------------------


def _ready_worker(server: Serve, not_pid: int = 0) -> dict[str, Any]:
    health = server.wait_health(
        lambda h: h["status"] == "ready" and h["worker"] is not None
        and h["worker"]["pid"] != not_pid, timeout=240)
    worker: dict[str, Any] = health["worker"]
    return worker


def test_a_restarted_worker_keeps_the_verdict_until_its_files_change(
        tiny_snapshot: Path, tmp_path: Path) -> None:
    """Production defaults but the model: kill the worker, the front restarts it on the same
    weights and it reports `reused: true`; replace the weights file in place, kill it again,
    and the new worker checks again and passes."""
    snapshot = _copy(tiny_snapshot, tmp_path)
    with Serve(real_worker=True, front_args=("--model", str(snapshot), "--device", "cpu"),
               startup_wait=240) as server:
        first = _ready_worker(server)
        assert first["self_check"]["passed"] and first["self_check"]["reused"] is False
        killed_at = time.monotonic()
        os.kill(first["pid"], signal.SIGKILL)
        second = _ready_worker(server, not_pid=first["pid"])
        print(f"kill to ready on the kept verdict: {time.monotonic() - killed_at:.1f} s")
        verdict = second["self_check"]
        assert verdict["reused"] is True and verdict["passed"] is True
        assert verdict["layout"] == first["self_check"]["layout"]
        assert verdict["probes"] == first["self_check"]["probes"]
        metrics = server.request("GET", "/metrics").body.decode()
        assert f'clef_worker_self_check_reused{{layout="{verdict["layout"]}"}} 1.0' in metrics
        _perturb_weights(snapshot)
        os.kill(second["pid"], signal.SIGKILL)
        third = _ready_worker(server, not_pid=second["pid"])
        assert third["self_check"]["reused"] is False and third["self_check"]["passed"] is True
        kept = list(verdict_store.default_directory().glob("*.json"))
        assert len(kept) == 2  # one verdict per weights
        keys = [json.loads(path.read_text())["key"]["weights"]["fingerprint"] for path in kept]
        assert len(set(keys)) == 2

"""The kernel caches default to a directory that outlives the process, unless the operator
chose one, and start-up says whether they were warm."""

from __future__ import annotations

from pathlib import Path

import pytest

from clef_protocol.messages import ReadyInfo, ready
from clef_worker.gpu.kernel_cache import (
    FLA_CACHE_RESULTS_ENV,
    TRITON_CACHE_ENV,
    prepare_kernel_cache,
    service_cache_root,
)


def test_the_default_lives_in_the_service_cache_and_turns_warm(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    first = prepare_kernel_cache(env, root=tmp_path)
    assert env[TRITON_CACHE_ENV] == str(tmp_path / "triton") == str(first.directory)
    assert env[FLA_CACHE_RESULTS_ENV] == "1"
    assert first.directory.is_dir() and first.state == "cold" and not first.from_operator
    (first.directory / "kernel.json").write_text("{}")  # what a compile leaves behind
    again = prepare_kernel_cache({}, root=tmp_path)
    assert again.state == "warm"


def test_the_operators_choice_is_kept(tmp_path: Path) -> None:
    chosen = tmp_path / "mine"
    env = {TRITON_CACHE_ENV: str(chosen), FLA_CACHE_RESULTS_ENV: "0"}
    cache = prepare_kernel_cache(env, root=tmp_path / "unused")
    assert env == {TRITON_CACHE_ENV: str(chosen), FLA_CACHE_RESULTS_ENV: "0"}
    assert cache.directory == chosen and cache.from_operator
    assert not (tmp_path / "unused").exists()


def test_the_service_cache_root_follows_its_environment(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLEF_SERVE_CACHE", str(tmp_path / "svc"))
    assert service_cache_root() == tmp_path / "svc"


def test_an_unusable_directory_is_reported_cold(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = prepare_kernel_cache({TRITON_CACHE_ENV: str(blocker / "triton")})
    assert cache.state == "cold"


def test_the_state_travels_in_the_ready_frame() -> None:
    info = ReadyInfo(model="m", variant="v", device="cuda:0", dtype="bfloat16", gdn_path="fla",
                     kernel_cache="warm", pid=1, thread="MainThread", warmup_ms=1.0)
    assert ReadyInfo.from_message(ready(info)).kernel_cache == "warm"

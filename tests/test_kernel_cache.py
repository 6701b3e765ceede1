"""The kernel caches default to a directory that outlives the process, unless the operator
chose one, and start-up says whether they were warm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_protocol.messages import ReadyInfo, ready
from clef_worker.starting.kernel_cache import (
    FLA_CACHE_RESULTS_ENV,
    KEY_FILE,
    TRITON_CACHE_ENV,
    cache_key,
    key_parts,
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


PARTS = {"gpu": {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}, "cuda": "12.8",
         "torch": "2.10.0", "triton": "3.6.0", "fla": "0.6.0", "dtype": "torch.bfloat16",
         "dimensions": {"hidden_size": 4096, "linear_num_value_heads": 32}}


def test_each_key_has_its_own_directory_and_its_own_warmth(tmp_path: Path) -> None:
    """A cache filled for one model's dimensions (or GPU, or library) is not another's: the
    tiny snapshot on Clef-Flash's warm cache is cold, in a directory of its own."""
    env: dict[str, str] = {}
    flash = prepare_kernel_cache(env, root=tmp_path, parts=PARTS)
    assert flash.directory.parent == tmp_path / "triton" and flash.key == flash.directory.name
    assert env[TRITON_CACHE_ENV] == str(flash.directory)
    assert flash.state == "cold"  # key.json alone is not a compiled kernel
    assert json.loads((flash.directory / KEY_FILE).read_text()) == PARTS
    (flash.directory / "kernel.json").write_text("{}")
    assert prepare_kernel_cache({}, root=tmp_path, parts=PARTS).state == "warm"
    for change in ({"dimensions": {"hidden_size": 64, "linear_num_value_heads": 4}},
                   {"gpu": {"type": "cuda", "name": "NVIDIA A100", "capability": [8, 0]}},
                   {"triton": "3.5.1"}, {"torch": "2.9.1"}, {"fla": "0.5.0"}):
        other = prepare_kernel_cache({}, root=tmp_path, parts={**PARTS, **change})
        assert other.directory != flash.directory and other.state == "cold", change
    assert cache_key(PARTS) == cache_key(dict(reversed(list(PARTS.items()))))


def test_an_operator_directory_is_the_base_of_the_keys(tmp_path: Path) -> None:
    chosen = tmp_path / "mine"
    env = {TRITON_CACHE_ENV: str(chosen)}
    cache = prepare_kernel_cache(env, root=tmp_path / "unused", parts=PARTS)
    assert cache.directory == chosen / cache_key(PARTS) and cache.from_operator
    assert env[TRITON_CACHE_ENV] == str(cache.directory)
    # A second executor in the same process does not key the keyed directory again.
    assert prepare_kernel_cache(env, parts=PARTS).directory == cache.directory


def test_the_key_parts_name_the_dimensions_and_libraries() -> None:
    import torch

    parts = key_parts(torch.device("cpu"), "torch.float32",
                      {"hidden_size": 64, "vocab_size": 524, "linear_key_head_dim": 16})
    assert parts["dimensions"] == {"hidden_size": 64, "linear_key_head_dim": 16}
    assert parts["torch"] == torch.__version__ and "triton" in parts and "fla" in parts
    assert parts["gpu"] == {"type": "cpu"}

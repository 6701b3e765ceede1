"""The start-up prefix probe fits `--max-length` (clef_worker.starting.prefix_probe): the cached
path is checked under any limit that lets the cache store a block, and where none can be stored the
cache is off for the worker with the reason in `ready`, never on and unchecked.

Workers start in this process at the production defaults but for `--max-length` (the setting
these tests are about); CUDA's long blocks (2,048 tokens) are reproduced on CPU by the
prefix cache's CPU block size patched to that figure.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from clef_protocol import messages
from clef_worker.serving.prefix import cache as prefix_cache
from clef_worker.starting.prefix_probe import MIN_SHARED_TOKENS, PROBE_NAME
from tests.worker_start import start_worker


def _prefix_probe(frame: dict) -> dict | None:
    probes = [p for p in frame["self_check"]["probes"] if p["name"] == PROBE_NAME]
    return probes[0] if probes else None


@pytest.mark.parametrize(("max_length", "block"), [(1024, 2048), (1024, 256), (512, 2048)])
def test_the_cached_path_is_checked_under_the_limit(tiny_snapshot: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    max_length: int, block: int) -> None:
    """The H200 sitting's case, --max-length 1024 with 2,048-token blocks, once skipped the
    probe and served hits unchecked: now the probe runs, reuses cached tokens and passes."""
    monkeypatch.setattr(prefix_cache, "BLOCK_TOKENS", block)
    executor, frame = start_worker(tiny_snapshot, "--max-length", str(max_length))
    assert executor is not None and frame["kind"] == messages.READY
    probe = _prefix_probe(frame)
    assert probe is not None, frame["self_check"]["probes"]
    assert probe["passed"] and probe["reused_tokens"] > 0 and "remedy" not in probe
    assert frame["prefix_cache"]["enabled"] is True
    assert frame["prefix_cache"]["block_tokens"] == block


def test_a_limit_with_no_room_for_a_cached_block_turns_the_cache_off(
        tiny_snapshot: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    limit = 400  # even the barest schemas leave under MIN_SHARED_TOKENS of state
    assert limit < MIN_SHARED_TOKENS + 122  # the barest schema: 122 tokens on this snapshot
    executor, frame = start_worker(tiny_snapshot, "--max-length", str(limit))
    assert executor is not None and frame["kind"] == messages.READY
    info = messages.ReadyInfo.from_message(frame).prefix_cache
    assert info is not None and not info.enabled
    assert info.disabled_reason.startswith(messages.PREFIX_CACHE_UNCHECKED)
    assert f"--max-length {limit}" in info.disabled_reason
    assert not info.turned_off  # configuration, not a disagreement: no alert
    assert any("the prefix cache is off for this worker" in r.getMessage()
               for r in caplog.records)
    probe = _prefix_probe(frame)
    assert probe is not None and "remedy" in probe
    assert frame["self_check"]["passed"] is True
    # Not kept: the next start on the same everything decides again, and says so again.
    _, again = start_worker(tiny_snapshot, "--max-length", str(limit))
    assert again["self_check"]["reused"] is False
    assert again["prefix_cache"]["enabled"] is False

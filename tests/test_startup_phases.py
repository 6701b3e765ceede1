"""Where a worker's start-up goes (`ready.startup`, `/health`, the log lines), and a restart that
keeps what the first start paid for: the real worker on the tiny snapshot behind clef-serve with
its defaults, its cache directory a fresh one (so the first start checks itself from nothing).

Structural, never timed against a bound: the phases must account for the start-up (they add up
to `ready_s` within 10 %), and a worker killed and restarted on the same weights, code and
device must skip the self-check by its kept verdict. How much faster the restart is belongs to
a benchmark (`bench/bench_startup.py`).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from benchlib.paths import TINY_SNAPSHOT
from clef_protocol.messages import STARTUP_PHASES
from tests.frontend_helpers import Serve


def assert_phases_account_for_the_start(startup: dict[str, Any]) -> None:
    assert set(startup["phases"]) == set(STARTUP_PHASES)
    total = sum(startup["phases"].values())
    assert startup["ready_s"] > 0
    assert abs(total - startup["ready_s"]) <= 0.1 * startup["ready_s"], startup
    # Each phase that must run on this worker did (CPU: no graphs to capture).
    for phase in ("imports_s", "load_s", "warm_s"):
        assert startup["phases"][phase] > 0, (phase, startup)


def test_phases_add_up_and_a_restart_keeps_the_verdict(tmp_path: Path) -> None:
    env = {"CLEF_SERVE_CACHE": str(tmp_path), "CLEF_SELF_CHECK_DIR": str(tmp_path / "verdicts")}
    with Serve(real_worker=True, startup_wait=240, env=env,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu")) as serve:
        health = serve.health().json()
        worker = health["worker"]
        first = worker["startup"]
        assert_phases_account_for_the_start(first)
        assert health["workers"][0]["startup"] == first
        assert worker["self_check"]["reused"] is False  # nothing kept yet: it checked
        assert first["phases"]["check_s"] > 0
        # The worker's own line and the front's both carry the figures.
        serve.wait_for(r"ready in [\d.]+ s \(imports_s [\d.]+, load_s ")
        serve.wait_for(rf"worker ready: .* pid={worker['pid']} .* ready_s=[\d.]+ imports_s=")

        os.kill(worker["pid"], signal.SIGKILL)
        serve.wait_for(rf"worker ready: .* pid=(?!{worker['pid']}\b)\d+ ", timeout=240)
        health = serve.health().json()
        again = health["worker"]
        assert again["pid"] != worker["pid"] and health["restarts"] == 1
        assert again["self_check"]["reused"] is True  # the kept verdict: no check ran
        assert again["self_check"]["passed"] is True
        assert_phases_account_for_the_start(again["startup"])
        assert health["workers"][0]["startup"] == again["startup"]

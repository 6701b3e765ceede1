"""Kept answers are bound to the weights that made them, through a real front and fake workers
that report the weights fingerprint a test writes (`--weights-file`): each response names its
weights in `Clef-Weights` (the access log too, and `/health` per worker); after the weights are
replaced and every worker restarted, one after the other, in either way (a SIGHUP roll, or each
worker killed), no answer of the old weights comes back, while a roll onto the same weights
keeps what was kept (test_answer_cache.py). Servers run the default configuration (answer cache
on); `--workers 2` because the scenario is about workers that differ."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from benchlib.http_client import clef_body
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric, restart_worker, workers_of

OLD, NEW = "0123456789abcdef" * 4, "fedcba9876543210" * 4



def test_a_roll_onto_new_weights_answers_from_them_and_names_them(tmp_path: Path) -> None:
    log, weights = tmp_path / "requests.log", tmp_path / "weights"
    weights.write_text(OLD)
    body = clef_body(tag="rolled")
    with Serve("--log-file", str(log), "--weights-file", str(weights),
               front_args=("--workers", "2")) as serve:
        first = serve.post(body)
        assert first.status == 200 and first.header("Clef-Weights") == OLD[:16]
        hit = serve.post(body)
        assert hit.body == first.body and hit.header("Clef-Weights") == OLD[:16]
        assert [w["models"] for w in workers_of(serve)] == [{"clef-flash": OLD}] * 2
        weights.write_text(NEW)
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_for(r"reload finished: 2 of 2 worker\(s\) replaced")
        after = serve.post(body)
        assert after.status == 200 and after.header("Clef-Weights") == NEW[:16]
        assert log.read_text().split() == ["rolled", "rolled"]  # computed anew, not kept
        assert serve.post(body).header("Clef-Weights") == NEW[:16]  # and now kept itself
        assert metric(serve, "clef_answer_cache_total", result="hit") == 2
        assert [w["models"] for w in workers_of(serve)] == [{"clef-flash": NEW}] * 2
        serve.wait_for(rf"status=200 .*weights={NEW[:16]} ")


def test_workers_restarted_one_after_the_other_never_bring_back_old_weights(
        tmp_path: Path) -> None:
    """While one worker still serves the old weights their kept answer may be served (a ready
    worker serves them); once both restarted on the new weights it never is, whichever worker
    restarted first."""
    log, weights = tmp_path / "requests.log", tmp_path / "weights"
    weights.write_text(OLD)
    with Serve("--log-file", str(log), "--weights-file", str(weights),
               front_args=("--workers", "2")) as serve:
        bodies = [clef_body(tag=f"q{i}") for i in range(4)]
        for body in bodies:
            assert serve.post(body).header("Clef-Weights") == OLD[:16]
        weights.write_text(NEW)
        restart_worker(serve, 0)
        for body in bodies:  # old weights still served by worker 1: kept answers hold
            assert serve.post(body).header("Clef-Weights") == OLD[:16]
        assert len(log.read_text().split()) == 4
        restart_worker(serve, 1)
        for body in bodies:
            answer = serve.post(body)
            assert answer.status == 200 and answer.header("Clef-Weights") == NEW[:16]
            assert json.loads(answer.body)["tag"] == json.loads(body)["tag"]
        assert len(log.read_text().split()) == 8  # each computed again by the new weights
        serve.wait_for(r"answer cache: 4 kept answer\(s\) of weights no ready worker serves")

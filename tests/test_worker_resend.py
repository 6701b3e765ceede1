"""No request lost to a worker's death: what was in flight on a lost worker is sent again, once,
alone on a ready worker (fake worker; the request log says what reached a worker)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from tests.frontend_helpers import Serve, background, clef_body
from tests.traffic_helpers import load, metric


def test_sigkill_of_one_of_two_workers_under_c4_load_costs_clients_nothing(
        tmp_path: Path) -> None:
    gate, log = tmp_path / "gate", tmp_path / "requests.log"
    with Serve("--delay", "0.01", "--log-file", str(log),
               front_args=("--workers", "2", "--max-batch", "2")) as serve:
        pid0, pid1 = (w["pid"] for w in serve.health().json()["workers"])
        # One request is surely in flight on worker 0 when it dies (held there until the gate).
        held = serve.hold_in_flight(gate, tag="held")
        assert serve.health().json()["workers"][0]["in_flight"] == 1
        bodies = [clef_body(tag=f"t{i}") for i in range(60)]
        killed = threading.Event()

        def kill_when_loaded() -> None:
            serve.wait_health(lambda h: h["in_flight"] >= 3)
            os.kill(pid0, signal.SIGKILL)
            gate.touch()
            killed.set()

        killer = background(kill_when_loaded)
        answers = load(serve, bodies, clients=4)
        killer.result()
        assert killed.is_set()
        assert [r.status for r, _ in answers] == [200] * len(bodies)
        assert [r.json()["tag"] for r, _ in answers] == [f"t{i}" for i in range(60)]
        rescued = held.result()
        assert rescued.status == 200 and rescued.json()["pid"] != pid0
        assert metric(serve, "clef_requests_resent_total", reason="crash") >= 1
        serve.wait_for(rf"worker pid={pid0} failed")
        assert log.read_text().split().count("held") == 2  # sent twice: to pid0, then again
        assert pid1 in {r.json()["pid"] for r, _ in answers}


def test_a_poison_request_costs_at_most_two_workers_then_service_resumes(
        tmp_path: Path) -> None:
    gate, log, gate_b = tmp_path / "gate", tmp_path / "requests.log", tmp_path / "gate_b"
    with Serve("--log-file", str(log),
               front_args=("--workers", "2", "--max-batch", "2")) as serve:
        # a (poison, held) and c share worker 0; b runs on worker 1 (held meanwhile, so the
        # least loaded worker for c is worker 0 again).
        poison = background(lambda: serve.post(clef_body(tag="a", crash=True,
                                                         hold_until=str(gate))))
        serve.wait_health(lambda h: h["in_flight"] == 1)
        other = background(lambda: serve.post(clef_body(tag="b", hold_until=str(gate_b))))
        serve.wait_health(lambda h: h["workers"][1]["in_flight"] == 1)
        companion = background(lambda: serve.post(clef_body(tag="c", sleep=0.05)))
        serve.wait_health(lambda h: h["workers"][0]["in_flight"] == 2)
        gate_b.touch()
        assert other.result().status == 200
        gate.touch()
        refused = poison.result()
        assert (refused.status, refused.detail) == (500, "inference failed")
        assert companion.result().status == 200  # its companion is answered
        # It killed its first worker and, sent again alone, one more: never a third.
        after = serve.wait_health(lambda h: h["status"] == "ready" and h["restarts"] == 2
                                  and h["ready_workers"] == ["0", "1"])
        assert log.read_text().split().count("a") == 2
        assert metric(serve, "clef_requests_resent_total", reason="crash") == 2  # a and c
        assert serve.post(clef_body(tag="next")).status == 200
        assert after["restarts"] == 2
        serve.wait_for(r"frame_id=\d+ request_id=\S+ failed: worker closed its output")

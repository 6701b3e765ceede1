"""Several requests in flight per worker, several workers, and rolling reloads (fake worker)."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import threading
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clef_dispatch import worker_pool
from clef_dispatch.settings import WorkerSettings, workers_from
from clef_dispatch.worker_pool import plan_slots
from clef_frontend.cli import build_parser
from clef_frontend.config import ServerConfig
from clef_protocol.options import DEFAULT_MAX_BATCH_CPU
from tests.frontend_helpers import WAIT, Response, Serve, background, clef_body


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_devices_pin_each_worker_with_cuda_visible_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(worker_pool, "host_cores", lambda: 16)
    slots = plan_slots(WorkerSettings(("w", "--device", "auto"), devices=("cuda:0", "cuda:3"),
                                      workers_per_device=2))
    assert [s.name for s in slots] == ["cuda:0#0", "cuda:0#1", "cuda:3#0", "cuda:3#1"]
    assert [s.env for s in slots] == [{"CUDA_VISIBLE_DEVICES": "0"}] * 2 + \
        [{"CUDA_VISIBLE_DEVICES": "3"}] * 2
    assert all(s.argv[-2:] == ("--device", "cuda") for s in slots)  # the last --device wins
    plain = plan_slots(WorkerSettings(worker_argv=("w",), workers_per_device=2))
    split = {"OMP_NUM_THREADS": "8"}  # two unpinned workers share the 16 cores
    assert [(s.name, s.argv, s.env) for s in plain] == [("0", ("w",), split),
                                                         ("1", ("w",), split)]


def test_unpinned_workers_split_the_cores_unless_the_operator_chose(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Several CPU workers would each start a thread per core and fight over them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(worker_pool, "host_cores", lambda: 2)
    one = plan_slots(WorkerSettings(worker_argv=("w", "--device", "cpu")))
    assert [s.env for s in one] == [{}]  # one worker keeps torch's own choice
    cpu = plan_slots(WorkerSettings(worker_argv=("w",), devices=("cpu", "cuda:1"),
                                  workers_per_device=3))
    assert [s.env for s in cpu] == [{"OMP_NUM_THREADS": "1"}] * 3 + \
        [{"CUDA_VISIBLE_DEVICES": "1"}] * 3
    assert worker_pool.shared_core_env(4, environ={}, cores=18) == {"OMP_NUM_THREADS": "4"}
    assert worker_pool.shared_core_env(2, environ={"OMP_NUM_THREADS": "3"}, cores=8) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    chosen = plan_slots(WorkerSettings(worker_argv=("w",), workers_per_device=2))
    assert [s.env for s in chosen] == [{}, {}]


def test_worker_flags_become_devices_and_counts() -> None:
    assert workers_from(_parse("--devices", "cuda:0,cuda:1")) == (("cuda:0", "cuda:1"), 1)
    assert workers_from(_parse("--device", "cuda", "--workers", "3")) == \
        (("cuda:0", "cuda:1", "cuda:2"), 1)
    assert workers_from(_parse("--device", "cpu", "--workers", "2",
                               "--workers-per-device", "2")) == ((), 4)
    assert workers_from(_parse()) == ((), 1)
    for bad in ("cuda:0,cuda:0", "gpu0", "cuda:x"):
        with pytest.raises(SystemExit):
            _parse("--devices", bad)


def _posts(serve: Serve, tags: list[str], clients: int = 8) -> list[Response]:
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(lambda tag: serve.post(clef_body(tag=tag)), tags))


def test_two_workers_answer_every_request_exactly_once_in_order_per_worker(
    tmp_path: Path,
) -> None:
    log_file = tmp_path / "received"
    tags = [f"r{i}" for i in range(40)]
    with Serve("--delay", "0.005", "--log-file", str(log_file),
               front_args=("--workers", "2", "--max-batch", "3")) as serve:
        health = serve.health().json()
        assert health["ready_workers"] == ["0", "1"]
        assert [w["max_batch"] for w in health["workers"]] == [3, 3]
        responses = _posts(serve, tags)
    assert [r.status for r in responses] == [200] * len(tags)
    answers = [r.json() for r in responses]
    assert [a["tag"] for a in answers] == tags  # each client got its own answer
    # Each request reached a worker exactly once.
    assert Counter(log_file.read_text().split()) == Counter(tags)
    by_pid: dict[int, list[dict]] = defaultdict(list)
    for answer in answers:
        by_pid[answer["pid"]].append(answer)
    assert len(by_pid) == 2  # both workers served
    for mine in by_pid.values():
        # Completion order on each worker is its admission order (ids are given at admission).
        mine.sort(key=lambda a: a["request_id"])
        ends = [a["end_ns"] for a in mine]
        assert ends == sorted(ends)


def test_a_crash_mid_batch_sends_that_batch_again_each_alone(tmp_path: Path) -> None:
    gate0, gate1, log = tmp_path / "gate0", tmp_path / "gate1", tmp_path / "requests.log"
    with Serve("--crash-once-file", str(tmp_path / "crashed"), "--log-file", str(log),
               front_args=("--workers", "2", "--max-batch", "2")) as serve:
        pid0, pid1 = (w["pid"] for w in serve.health().json()["workers"])

        def send(in_flight: int, **markers: object) -> background:
            call = background(lambda: serve.post(clef_body(**markers)))
            serve.wait_health(lambda h: h["in_flight"] == in_flight)
            return call

        # Round robin from worker 0: a, c on worker 0; b, d on worker 1; e waits in the queue.
        a = send(1, tag="a", crash=True, hold_until=str(gate0))
        b = send(2, tag="b", hold_until=str(gate1))
        c = send(3, tag="c")
        d = send(4, tag="d")
        e = background(lambda: serve.post(clef_body(tag="e")))
        serve.wait_health(lambda h: h["queue_depth"] == 1)
        gate0.touch()  # worker 0 crashes with a and c in flight: both are sent again
        again = [a.result(), c.result()]
        assert [(r.status, r.json()["tag"]) for r in again] == [(200, "a"), (200, "c")]
        replacement = serve.health().json()["workers"][0]["pid"]
        assert replacement not in (pid0, pid1)
        assert {r.json()["pid"] for r in again} == {replacement}
        # Each ran alone on the replacement: c was sent only once a was answered.
        assert again[1].json()["start_ns"] >= again[0].json()["end_ns"]
        gate1.touch()
        answered = [r.result() for r in (b, d, e)]
        assert [r.status for r in answered] == [200, 200, 200]
        assert [r.json()["tag"] for r in answered] == ["b", "d", "e"]
        assert {r.json()["pid"] for r in answered[:2]} == {pid1}
        # The dead worker read a (c was still on its pipe); worker 1 read b, then d after it.
        lines = log.read_text().split()
        assert lines[:4] == ["a", "b", "a", "c"] and sorted(lines[4:]) == ["d", "e"]
        serve.wait_for(r"frame_id=\d+ request_id=\S+ lost with its worker .*sending it again")


def test_killing_one_worker_leaves_the_other_serving_without_503(tmp_path: Path) -> None:
    marker, gate = tmp_path / "replacements wait", tmp_path / "gate"
    with Serve("--crash-once-file", str(marker), "--replacement-ready-gate", str(gate),
               front_args=("--workers", "2")) as serve:
        before = serve.health().json()
        pid0, pid1 = (w["pid"] for w in before["workers"])
        marker.touch()  # from now on a replacement waits for the gate before `ready`
        os.kill(pid0, signal.SIGKILL)
        serve.wait_for(rf"worker pid={pid0} failed")
        during = serve.health()
        document = during.json()
        assert during.status == 200 and document["status"] == "ready"
        assert document["ready_workers"] == ["1"]
        assert [w["status"] for w in document["workers"]] == ["restarting", "ready"]
        assert document["worker"]["pid"] == pid1
        responses = _posts(serve, [f"t{i}" for i in range(12)], clients=4)
        assert [r.status for r in responses] == [200] * 12
        assert {r.json()["pid"] for r in responses} == {pid1}
        gate.touch()
        after = serve.wait_health(lambda h: h["ready_workers"] == ["0", "1"])
        assert after["workers"][0]["pid"] not in (pid0, pid1)
        assert after["workers"][0]["restarts"] == 1 and after["restarts"] == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_rolls_the_workers_and_answers_every_request_meanwhile(workers: str) -> None:
    with Serve("--ready-delay", "0.2", front_args=("--workers", workers)) as serve:
        old = {w["pid"] for w in serve.health().json()["workers"]}
        stop, served_by_new = threading.Event(), threading.Event()
        results: list[Response] = []

        def client(name: int) -> None:
            i = 0
            while not stop.is_set():
                response = serve.post(clef_body(tag=f"{name}-{i}"))
                results.append(response)
                if response.status == 200 and response.json()["pid"] not in old:
                    served_by_new.set()
                i += 1

        with ThreadPoolExecutor(max_workers=3) as pool:
            clients = [pool.submit(client, n) for n in range(3)]
            serve.process.send_signal(signal.SIGHUP)
            serve.wait_for(rf"reload finished: {workers} of {workers} worker\(s\) replaced")
            assert served_by_new.wait(WAIT)
            stop.set()
            for future in clients:
                future.result()
        new = {w["pid"] for w in serve.health().json()["workers"]}
        assert results and {r.status for r in results} == {200}
        assert not new & old and len(new) == int(workers)
        pids = {r.json()["pid"] for r in results}
        assert pids & old and pids & new  # served by the old workers, then by the new ones


def test_sighup_runs_every_reload_callback_even_when_one_fails() -> None:
    from clef_frontend.server import FrontServer

    async def scenario() -> list[str]:
        ran: list[str] = []
        done = asyncio.Event()
        server = FrontServer(ServerConfig(WorkerSettings(("unused",))))

        def broken() -> None:
            raise OSError("key file unreadable")

        async def keys() -> None:
            ran.append("async")
            done.set()

        server.on_reload(broken)
        server.on_reload(lambda: ran.append("sync"))
        server.on_reload(keys)
        server.reload()  # the pool's own callback comes first: no worker is ready, so it skips
        await asyncio.wait_for(done.wait(), WAIT)
        return ran

    assert asyncio.run(scenario()) == ["sync", "async"]


def test_one_worker_failing_at_start_stops_the_start_unbound(tmp_path: Path) -> None:
    poison = tmp_path / "poison"
    poison.touch()  # the first worker to look refuses to start; the other one is fine
    serve = Serve("--fatal-once-file", str(poison), front_args=("--workers", "2"),
                  wait_listening=False)
    with serve:
        assert serve.wait_exit() == 1
    assert re.search(r"not listening: worker [01]: worker could not start: GPU still held",
                     serve.stderr)
    assert "listening on http://" not in serve.stderr


def test_the_in_flight_cap_is_what_ready_reports() -> None:
    """The front keeps in flight on a worker what its `ready` says: without --max-batch the
    fake worker, resolving its flags as the real one does, reports its device's default (CPU,
    chosen by measurement, docs/benchmarks.md). A worker of its own that reports no batch
    policy gets one request at a time, never a guess at the worker's defaults."""
    with Serve(max_batch=None) as serve:
        [worker] = serve.health().json()["workers"]
    assert worker["max_batch"] == DEFAULT_MAX_BATCH_CPU
    with Serve("--no-batch-policy", max_batch=None) as serve:
        [worker] = serve.health().json()["workers"]
        assert worker["max_batch"] == 1
        assert serve.post(clef_body()).status == 200

"""The dispatch never waits on one request: a request lost with its worker, for a fine-tuned
variant no ready worker serves any more, is answered (404 naming the model once no worker lists
it) and the queue moves on; a lost request's deadline passing runs the dispatch, so what waited
behind it is sent. Over HTTP with the fake worker serving the `--finetune` checkpoints it finds
at start (`--fake-variants`), then admission over fake lanes."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

from benchlib.paths import FINETUNE_FIXTURES
from clef_api.responses import from_outcome
from clef_dispatch import admission as admission_module
from clef_dispatch.outcomes import Refusal
from clef_dispatch.worker_errors import WorkerExited
from tests.doubles import Admission, FakeLane, FakeWorkers
from tests.frontend_helpers import Serve, clef_body


def test_a_lost_request_for_a_removed_variant_is_404_and_the_queue_moves_on(
        tmp_path: Path) -> None:
    """A worker dies holding a request for a variant whose checkpoint was removed just before;
    its replacement no longer serves it: the lost request is answered 404 naming the model
    (never sent again, never held until its deadline), and a base request is served at once."""
    directory, gate = tmp_path / "finetune", tmp_path / "gate"
    for name in ("tiny-alpha", "tiny-beta"):
        shutil.copytree(FINETUNE_FIXTURES / name, directory / name)
    with Serve("--fake-variants", front_args=("--finetune", str(directory))) as serve:
        held = serve.hold_in_flight(gate, body=clef_body(model="tiny-beta",
                                                         hold_until=str(gate)))
        pid = serve.health().json()["workers"][0]["pid"]
        shutil.rmtree(directory / "tiny-beta")
        os.kill(pid, signal.SIGKILL)
        lost = held.result(timeout=60)
        assert lost.status == 404, lost.body
        assert lost.detail.startswith("unknown model 'tiny-beta'")
        base = serve.post(clef_body(model="clef-flash"))
        assert base.status == 200 and base.json()["pid"] != pid
        health = serve.health().json()
        assert health["queue_depth"] == 0 and health["in_flight"] == 0
        assert serve.post(clef_body(model="tiny-beta")).status == 404  # the catalogue agrees


def test_a_lost_request_no_ready_worker_serves_is_answered_and_the_rest_go() -> None:
    """Over fake lanes: the lane serving `v` is lost with a request for it and is not ready;
    the other is: the lost request is answered at once (503 while the restarting lane still
    lists `v`), and a base request goes to the ready lane."""
    async def scenario() -> None:
        serving_v, other = FakeLane(room=2, variants=("v",)), FakeLane(room=2)
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(serving_v, other))
        lost = admission.submit(b"v", model="v")
        assert serving_v.sent == [b"v"]
        serving_v.ready = False  # lost, restarting
        _, deliver = serving_v.held.pop()
        deliver(WorkerExited("worker closed its output"))
        refusal = from_outcome(await lost.outcome)
        assert refusal.status == 503
        admission.submit(b"base")
        assert other.sent == [b"base"]
        serving_v.variants = set()  # its replacement started without `v`
        again = admission_module.Admission.submit(admission, b"v again", model="v")
        assert isinstance(again, Refusal)  # no ready worker serves it and none lists it
        assert from_outcome(again).status == 404

    asyncio.run(scenario())


def test_a_lost_requests_deadline_passing_sends_what_waited_behind_it() -> None:
    """A lost request waits for an idle worker serving its model (nothing new is sent
    meanwhile); when its deadline passes it is answered 504 and the request behind it goes to
    the worker with room at once, not at the next reply."""
    async def scenario() -> None:
        busy, free = FakeLane(room=2, variants=("v",)), FakeLane(room=2)
        admission = Admission(capacity=10, retry_after=1, workers=FakeWorkers(busy, free))
        admission.submit(b"first")  # on `busy`: it will not be idle
        lost = admission.submit(b"v", model="v", deadline=time.monotonic() + 0.05)
        assert busy.sent == [b"first", b"v"]
        _, deliver = busy.held.pop()
        deliver(WorkerExited("worker closed its output"))  # lost: waits for `busy` to idle
        behind = admission.submit(b"behind")
        assert free.sent == [] and not behind.outcome.done()  # held back by the lost one
        assert from_outcome(await lost.outcome).status == 504
        assert free.sent == [b"behind"]

    asyncio.run(scenario())

"""Fine-tuned variants changing under a running server, through the real front and real workers
in the configuration operators run (answer cache on, the worker's CPU defaults), with
`--finetune` naming a copy of the fixture directory that the tests change:

- a checkpoint removed, then the workers restarted one after the other: while one worker still
  has it, requests naming it go to that worker only (each answered by the variant itself); once
  none has it, it is 404 `unknown model` and gone from `/v1/models`, never a 200 from the base,
  kept answers included;
- a checkpoint's files replaced in place, then the worker restarted: the same request gets the
  new weights' answer, never the kept one, and `Clef-Weights` names the new weights;
- SIGHUP rolls the workers onto a checkpoint added to the directory: it is listed and served;
  and off one removed, one worker at a time under traffic, never answering it with another model;
- a worker alone scores only the names it was given, refusing any other (404).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, cast

from benchlib.golden import assert_response_matches
from benchlib.paths import FINETUNE_FIXTURES, FINETUNE_REFERENCE
from clef_protocol import messages
from clef_protocol.frames import read_frame_blocking, write_frame_blocking
from clef_protocol.options import RequestLimits
from tests.conftest import REPO, TINY_SNAPSHOT
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric, restart_worker, workers_of

MAX_LENGTH = RequestLimits().max_length
REFERENCE = [json.loads(line) for line in FINETUNE_REFERENCE.read_text().splitlines() if line]
ROWS = {(row["variant"], row["name"]): row for row in REFERENCE
        if row["max_length"] == MAX_LENGTH}
VARIANT_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors",
                 "joint_head.safetensors")


def _checkpoints(tmp_path: Path) -> Path:
    directory = tmp_path / "finetune"
    for name in ("tiny-alpha", "tiny-beta"):
        shutil.copytree(FINETUNE_FIXTURES / name, directory / name)
    return directory


def _serve(directory: Path, workers: int) -> Serve:
    return Serve(real_worker=True, startup_wait=240, max_batch=None,
                 front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                             "--finetune", str(directory), "--workers", str(workers)))


def _post(serve: Serve, request: dict[str, Any]) -> Any:
    return serve.post(json.dumps(request, ensure_ascii=False).encode())



def _listed(serve: Serve) -> list[str]:
    return [entry["id"] for entry in serve.request("GET", "/v1/models").json()["data"]]


def test_a_removed_variant_is_refused_once_no_worker_has_it(tmp_path: Path) -> None:
    directory = _checkpoints(tmp_path)
    names = ["invoice", "object_state", "array_state", "choice_sort_order", "empty_state",
             "unicode_ids"]
    with _serve(directory, workers=2) as serve:
        kept = ROWS[("tiny-beta", "invoice")]
        assert _post(serve, kept["request"]).status == 200  # kept for repeats
        shutil.rmtree(directory / "tiny-beta")
        restart_worker(serve, 0)
        assert [sorted(w["models"]) for w in workers_of(serve)] == [
            ["clef-flash", "tiny-alpha"], ["clef-flash", "tiny-alpha", "tiny-beta"]]
        assert _listed(serve) == ["clef-flash", "tiny-alpha", "tiny-beta"]
        # Only worker 1 still has it: every request naming it goes there and is the variant's
        # own answer (worker 0 would refuse the name, the base would answer otherwise).
        for name in names:
            row = ROWS[("tiny-beta", name)]
            response = _post(serve, row["request"])
            assert response.status == 200, (name, response.body)
            assert_response_matches(response.json(), row["response"])
        restart_worker(serve, 1)
        assert _listed(serve) == ["clef-flash", "tiny-alpha"]
        for row in (kept, ROWS[("tiny-beta", "object_state")]):
            response = _post(serve, row["request"])
            assert response.status == 404, response.body
            assert response.detail == ("unknown model 'tiny-beta'; this server runs "
                                       "clef-flash, tiny-alpha")
        alpha = ROWS[("tiny-alpha", "invoice")]
        response = _post(serve, alpha["request"])
        assert response.status == 200
        assert_response_matches(response.json(), alpha["response"])


def test_a_variants_files_replaced_in_place_answer_with_the_new_weights(tmp_path: Path) -> None:
    directory = _checkpoints(tmp_path)
    row = ROWS[("tiny-alpha", "invoice")]
    with _serve(directory, workers=1) as serve:
        before = _post(serve, row["request"])
        assert before.status == 200
        assert_response_matches(before.json(), row["response"])
        old_weights = before.header("Clef-Weights")
        assert old_weights == workers_of(serve)[0]["models"]["tiny-alpha"][:16]
        assert _post(serve, row["request"]).body == before.body  # kept: a hit
        hits = metric(serve, "clef_answer_cache_total", result="hit")
        for name in VARIANT_FILES:  # tiny-beta's adapter and head copied over tiny-alpha's
            shutil.copyfile(directory / "tiny-beta" / name, directory / "tiny-alpha" / name)
        restart_worker(serve, 0)
        after = _post(serve, row["request"])
        assert after.status == 200
        beta = ROWS[("tiny-beta", "invoice")]["response"]
        assert_response_matches(after.json(), dict(beta, model="tiny-alpha"))
        assert after.body != before.body
        new_weights = after.header("Clef-Weights")
        assert new_weights == workers_of(serve)[0]["models"]["tiny-alpha"][:16] != old_weights
        assert metric(serve, "clef_answer_cache_total", result="hit") == hits  # not from memory


def test_sighup_picks_up_a_checkpoint_added_to_the_directory(tmp_path: Path) -> None:
    directory = _checkpoints(tmp_path)
    request = dict(ROWS[("tiny-alpha", "invoice")]["request"], model="tiny-gamma")
    with _serve(directory, workers=1) as serve:
        assert _post(serve, request).status == 404
        shutil.copytree(directory / "tiny-alpha", directory / "tiny-gamma")
        serve.process.send_signal(signal.SIGHUP)
        serve.wait_for(r"reload finished: 1 of 1 worker\(s\) replaced", timeout=240)
        assert _listed(serve) == ["clef-flash", "tiny-alpha", "tiny-beta", "tiny-gamma"]
        response = _post(serve, request)
        assert response.status == 200, response.body
        expected = ROWS[("tiny-alpha", "invoice")]["response"]
        assert_response_matches(response.json(), dict(expected, model="tiny-gamma"))


def test_the_worker_scores_only_the_names_it_was_given() -> None:
    """The worker on its own (its frames, no front): with variants it scores the base under the
    served names it was given and each variant under its name, names each answer's weights as
    its `ready` lists them, and refuses any other name 404 rather than score it as the base."""
    command = [sys.executable, "-m", "clef_worker", "--model", str(TINY_SNAPSHOT),
               "--device", "cpu", "--finetune", str(FINETUNE_FIXTURES),
               "--served-model-name", "clef-flash", "clef-alias"]
    worker = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert worker.stdin is not None and worker.stdout is not None
    to_worker, from_worker = cast(BinaryIO, worker.stdin), cast(BinaryIO, worker.stdout)
    try:
        ready = messages.from_worker(read_frame_blocking(from_worker) or {})
        assert isinstance(ready, messages.ReadyInfo)
        assert sorted(ready.models) == ["clef-flash", "tiny-alpha", "tiny-beta"]
        assert ready.models["clef-flash"] == ready.fingerprint
        assert len(set(ready.models.values())) == 3
        request = ROWS[("tiny-alpha", "invoice")]["request"]
        for frame_id, model in enumerate(("clef-alias", "tiny-alpha", "tiny-gone"), start=1):
            body = json.dumps(dict(request, model=model)).encode()
            write_frame_blocking(to_worker, messages.request(frame_id, body))
            reply = messages.from_worker(read_frame_blocking(from_worker) or {})
            assert isinstance(reply, messages.WorkerReply) and reply.id == frame_id
            if model == "tiny-gone":
                assert (reply.status, reply.detail) == (404, (
                    "unknown model 'tiny-gone'; this worker serves clef-alias, clef-flash, "
                    "tiny-alpha, tiny-beta"))
            else:
                expected = "clef-flash" if model == "clef-alias" else model
                assert reply.status == 200 and reply.weights == ready.models[expected]
        write_frame_blocking(to_worker, messages.shutdown())
        assert worker.wait(60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_sighup_drops_a_removed_checkpoint_one_worker_at_a_time(tmp_path: Path) -> None:
    """Under traffic: while the roll replaces one worker after the other, the base never fails
    and a request naming the removed variant gets that variant's answer (from a worker that
    still has it), 503 or 404, never another model's answer; after the roll it is 404."""
    directory = _checkpoints(tmp_path)
    beta = ROWS[("tiny-beta", "object_state")]
    base = dict(ROWS[("tiny-beta", "object_state")]["request"], model="clef-flash")
    seen: list[tuple[str, int, str | None]] = []
    stop = threading.Event()

    def client(serve: Serve) -> None:
        tag = 0
        while not stop.is_set():
            tag += 1  # distinct bodies: each is a forward, not a kept answer
            for name, request in (("beta", beta["request"]), ("base", base)):
                response = _post(serve, dict(request, state=f"{request['state']} #{tag}"))
                seen.append((name, response.status, response.header("Clef-Weights")))

    with _serve(directory, workers=2) as serve:
        models = workers_of(serve)[0]["models"]
        weights = {"beta": models["tiny-beta"][:16], "base": models["clef-flash"][:16]}
        shutil.rmtree(directory / "tiny-beta")
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(client, serve)
            serve.process.send_signal(signal.SIGHUP)
            serve.wait_for(r"reload finished: 2 of 2 worker\(s\) replaced", timeout=480)
            stop.set()
            running.result()
        assert {status for name, status, _ in seen if name == "base"} == {200}
        for name, status, named in seen:  # each answer by the weights of the model it names
            assert status in ((200,) if name == "base" else (200, 503, 404))
            assert named == (weights[name] if status == 200 else None)
        assert _listed(serve) == ["clef-flash", "tiny-alpha"]
        assert _post(serve, beta["request"]).status == 404

"""What a `--finetune` directory may hold at a roll (SIGHUP) or a worker's replacement, through
the real front and a real worker in the configuration operators run (answer cache on, the
worker's CPU defaults):

- a checkpoint copied in under the served model's name never takes the base over: it is
  refused with a log line naming it, the base keeps its answers, its `Clef-Weights` and its
  place in `/health`, and a fresh start on the same directory serves the rest;
- a directory left empty serves the base alone: at start, and after the last checkpoint is
  removed (the roll succeeds, the removed variant is 404 and gone from `/v1/models`, and a
  crash afterwards is only a restart, never an outage); a bad entry is refused on its own while
  the others are served;
- a checkpoint whose `adapter/` is a symbolic link: adapter files replaced through the link
  are new weights (a new fingerprint, no kept answer of the old ones).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

from benchlib.golden import assert_response_matches, case
from benchlib.paths import FINETUNE_FIXTURES, FINETUNE_REFERENCE
from clef_protocol.options import RequestLimits
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Response, Serve
from tests.traffic_helpers import metric, restart_worker, wait_until, workers_of

MAX_LENGTH = RequestLimits().max_length
REFERENCE = [json.loads(line) for line in FINETUNE_REFERENCE.read_text().splitlines() if line]
ROWS = {(row["variant"], row["name"]): row for row in REFERENCE
        if row["max_length"] == MAX_LENGTH}
ROLLED = re.compile(r"reload finished: (\d+) of (\d+) worker\(s\) replaced")


def _serve(directory: Path) -> Serve:
    return Serve(real_worker=True, startup_wait=240, max_batch=None,
                 front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu",
                             "--finetune", str(directory)))


def _post(serve: Serve, request: dict[str, Any]) -> Response:
    return serve.post(json.dumps(request, ensure_ascii=False).encode())


def _listed(serve: Serve) -> list[str]:
    return [entry["id"] for entry in serve.request("GET", "/v1/models").json()["data"]]


def _roll(serve: Serve) -> tuple[int, int]:
    """SIGHUP, then (workers replaced, workers) from the front's line once the roll is over."""
    seen = len(serve.lines)
    serve.process.send_signal(signal.SIGHUP)
    match = wait_until(lambda: next((m for line in serve.lines[seen:]
                                     if (m := ROLLED.search(line))), None),
                       "the roll to finish", timeout=240)
    return int(match[1]), int(match[2])


def _assert_base(serve: Serve, name: str, weights: str) -> None:
    """The base's own answer to golden case `name`, named by the base's weights."""
    golden = case(name)
    response = _post(serve, golden["request"])
    assert response.status == 200, response.body
    assert_response_matches(response.json(), golden["response"])
    assert response.header("Clef-Weights") == weights[:16]


def test_a_checkpoint_named_like_the_base_never_takes_it_over(tmp_path: Path) -> None:
    directory = tmp_path / "finetune"
    shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", directory / "tiny-alpha")
    with _serve(directory) as serve:
        base = workers_of(serve)[0]["models"]["clef-flash"]
        _assert_base(serve, "invoice", base)  # kept for repeats
        shutil.copytree(FINETUNE_FIXTURES / "tiny-beta", directory / "clef-flash")
        assert _roll(serve) == (1, 1)
        serve.wait_for(r"variant refused, not served: --finetune .*: clef-flash: 'clef-flash' "
                       r"is already a served model name")
        models = workers_of(serve)[0]["models"]
        assert sorted(models) == ["clef-flash", "tiny-alpha"] and models["clef-flash"] == base
        assert _listed(serve) == ["clef-flash", "tiny-alpha"]
        for name in ("invoice", "object_state", "array_state"):  # kept and fresh alike
            _assert_base(serve, name, base)
    with _serve(directory) as serve:  # a fresh start on the same directory serves the rest
        serve.wait_for(r"variant refused, not served: .*'clef-flash' is already a served")
        assert workers_of(serve)[0]["models"]["clef-flash"] == base
        _assert_base(serve, "choice_sort_order", base)
        alpha = ROWS[("tiny-alpha", "invoice")]
        response = _post(serve, alpha["request"])
        assert response.status == 200
        assert_response_matches(response.json(), alpha["response"])


def test_an_empty_directory_serves_the_base_and_a_bad_entry_only_itself(
        tmp_path: Path) -> None:
    directory = tmp_path / "finetune"
    directory.mkdir()
    alpha = ROWS[("tiny-alpha", "invoice")]
    with _serve(directory) as serve:  # empty at start: the base alone, no refusal to start
        base = workers_of(serve)[0]["models"]["clef-flash"]
        assert _listed(serve) == ["clef-flash"]
        assert _post(serve, alpha["request"]).status == 404
        _assert_base(serve, "invoice", base)

        shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", directory / "tiny-alpha")
        assert _roll(serve) == (1, 1)
        response = _post(serve, alpha["request"])  # kept for repeats
        assert response.status == 200, response.body
        assert_response_matches(response.json(), alpha["response"])

        shutil.rmtree(directory / "tiny-alpha")  # the last checkpoint removed
        assert _roll(serve) == (1, 1)
        assert _listed(serve) == ["clef-flash"]
        for _ in range(2):
            response = _post(serve, alpha["request"])
            assert response.status == 404, response.body
            assert response.detail == "unknown model 'tiny-alpha'; this server runs clef-flash"
            restart_worker(serve, 0)  # a crash after the roll: a restart, not an outage
            _assert_base(serve, "object_state", base)

        broken = directory / "tiny-broken"
        shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", broken)
        (broken / "adapter" / "adapter_config.json").write_text("{not json")
        shutil.copytree(FINETUNE_FIXTURES / "tiny-beta", directory / "tiny-beta")
        assert _roll(serve) == (1, 1)
        serve.wait_for(r"variant tiny-broken refused, not served: .*adapter_config\.json")
        assert _listed(serve) == ["clef-flash", "tiny-beta"]
        beta = ROWS[("tiny-beta", "object_state")]
        response = _post(serve, beta["request"])
        assert response.status == 200, response.body
        assert_response_matches(response.json(), beta["response"])
        restart_worker(serve, 0)
        assert sorted(workers_of(serve)[0]["models"]) == ["clef-flash", "tiny-beta"]


def test_adapter_files_replaced_through_a_symlink_are_new_weights(tmp_path: Path) -> None:
    directory, adapters = tmp_path / "finetune", tmp_path / "adapters"
    shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", directory / "tiny-alpha")
    shutil.move(str(directory / "tiny-alpha" / "adapter"), str(adapters))
    (directory / "tiny-alpha" / "adapter").symlink_to(adapters, target_is_directory=True)
    row = ROWS[("tiny-alpha", "invoice")]
    with _serve(directory) as serve:
        before = _post(serve, row["request"])
        assert before.status == 200
        assert_response_matches(before.json(), row["response"])
        old = workers_of(serve)[0]["models"]["tiny-alpha"]
        assert before.header("Clef-Weights") == old[:16]
        assert _post(serve, row["request"]).body == before.body  # kept: a hit
        hits = metric(serve, "clef_answer_cache_total", result="hit")
        for name in ("adapter_config.json", "adapter_model.safetensors"):  # through the link
            shutil.copyfile(FINETUNE_FIXTURES / "tiny-beta" / "adapter" / name, adapters / name)
        restart_worker(serve, 0)
        new = workers_of(serve)[0]["models"]["tiny-alpha"]
        assert new != old
        after = _post(serve, row["request"])
        assert after.status == 200 and after.body != before.body
        assert after.header("Clef-Weights") == new[:16]
        assert metric(serve, "clef_answer_cache_total", result="hit") == hits  # not from memory

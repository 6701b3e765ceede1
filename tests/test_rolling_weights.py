"""The base weights replaced in place under two real workers, restarted one after the other (the
order a rollout or a crash gives): once both run the new weights, no answer of the old weights
comes back, kept or not, whichever worker a request reaches; every answer names its weights in
`Clef-Weights`, and `/health` shows each worker's. Real front, real workers, the configuration
operators run (answer cache on, the worker's CPU defaults), `--workers 2`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchlib.golden import case
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve
from tests.traffic_helpers import restart_worker, workers_of

HEAD = "joint_head.safetensors"
CASES = ("invoice", "object_state", "array_state", "choice_sort_order")
# Asked while the workers differ (one restarted on the new weights, one still on the old).
BETWEEN = ("empty_state", "unicode_ids", "null_state", "big_integer")


def _perturbed_head(snapshot: Path) -> None:
    """Replace the snapshot's joint head in place by one moved by seeded noise."""
    tensors = load_file(str(snapshot / HEAD))
    generator = torch.Generator().manual_seed(11)
    moved = {name: (tensor.float() + torch.randn(tensor.shape, generator=generator)
                    ).to(tensor.dtype) for name, tensor in tensors.items()}
    save_file(moved, str(snapshot / HEAD))



def test_no_old_answer_once_both_workers_run_the_new_weights(tmp_path: Path) -> None:
    served = tmp_path / "model"
    shutil.copytree(TINY_SNAPSHOT, served)
    bodies = [json.dumps(case(name)["request"]).encode() for name in CASES]
    with Serve(real_worker=True, startup_wait=240, max_batch=None,
               front_args=("--model", str(served), "--device", "cpu",
                           "--workers", "2")) as serve:
        old = {worker["models"]["clef-flash"] for worker in workers_of(serve)}
        assert len(old) == 1
        old_weights = old.pop()
        before = []
        for body in bodies:
            response = serve.post(body)
            assert response.status == 200 and response.header("Clef-Weights") == old_weights[:16]
            before.append(response.body)
        _perturbed_head(served)
        restart_worker(serve, 0)
        # Meanwhile each worker answers (and the cache keeps) with its own weights, and says so.
        between = [json.dumps(case(name)["request"]).encode() for name in BETWEEN]
        named = [serve.post(body).header("Clef-Weights") for body in between]
        assert set(named) == {old_weights[:16], workers_of(serve)[0]["models"]["clef-flash"][:16]}
        restart_worker(serve, 1)
        new = {worker["models"]["clef-flash"] for worker in workers_of(serve)}
        assert len(new) == 1 and old_weights not in new
        new_weights = new.pop()
        for _ in range(3):  # repeats: hits now, of the new weights' answers only
            for body, old_body in zip(bodies, before, strict=True):
                response = serve.post(body)
                assert response.status == 200
                assert response.header("Clef-Weights") == new_weights[:16]
                assert response.body != old_body
            for body in between:
                assert serve.post(body).header("Clef-Weights") == new_weights[:16]
        serve.wait_for(rf"status=200 .*cache=hit .*weights={new_weights[:16]} ")

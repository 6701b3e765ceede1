"""Kept answers follow the weights, not the path: an operator replaces the files at `--model`
in place and the worker restarts (here: killed); the same request then gets the new weights'
answer, never the one kept from the old weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from benchlib.golden import case
from tests.conftest import TINY_SNAPSHOT
from tests.frontend_helpers import Serve
from tests.traffic_helpers import metric, wait_until

HEAD = "joint_head.safetensors"


def _perturbed_copy(source: Path, target: Path) -> None:
    """Snapshot B: snapshot A with every joint-head weight moved by seeded noise."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / HEAD))
    generator = torch.Generator().manual_seed(7)
    moved = {name: (tensor.float() + torch.randn(tensor.shape, generator=generator)
                    ).to(tensor.dtype) for name, tensor in tensors.items()}
    save_file(moved, str(target / HEAD))


def test_replacing_the_weights_in_place_retires_the_kept_answers(tmp_path: Path) -> None:
    served, other = tmp_path / "model", tmp_path / "b"
    shutil.copytree(TINY_SNAPSHOT, served)
    _perturbed_copy(TINY_SNAPSHOT, other)
    body = json.dumps(case("invoice")["request"]).encode()
    with Serve(real_worker=True, startup_wait=240,
               front_args=("--model", str(served), "--device", "cpu")) as serve:
        before = serve.post(body)
        assert before.status == 200
        assert serve.post(body).body == before.body  # kept: a hit
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1
        for path in other.iterdir():  # the operator's copy over the served directory
            shutil.copyfile(path, served / path.name)
        pid = serve.health().json()["worker"]["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: (serve.health().json().get("worker") or {}).get("pid") not in
                   (None, pid), "the replacement worker", timeout=240)
        after = serve.post(body)
        assert after.status == 200
        assert after.body != before.body  # the new weights' answer
        assert metric(serve, "clef_answer_cache_total", result="hit") == 1  # not from memory

"""The whole server with the real worker on length buckets (`--cuda-graphs on` on CPU runs them
eagerly): the flags reach the worker, warm-up builds every bucket, `/health` reports them, and
golden answers come back unchanged, in a bucket and above the largest one; for the padded layout
(`[rows, bucket]` shapes) and the packed one (total-token buckets), whose worker also reports
the batch policy that sets the front's in-flight cap."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from clef_worker.serving.gpu.buckets import bucket_lengths
from tests.answer_compare import assert_same_response
from tests.conftest import GOLDEN, TINY_SNAPSHOT
from tests.frontend_helpers import Serve

CASES = {case["name"]: case for case in map(json.loads, GOLDEN.read_text().splitlines())}


@pytest.fixture(scope="module")
def serve() -> Iterator[Serve]:
    with Serve(
        # up to 8 requests per forward (the CPU default; --max-batch reaches the worker, whose
        # shapes follow it) in the padded layout, whose shapes this fixture checks
        real_worker=True, startup_wait=240, max_batch=8,
        front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu", "--cuda-graphs", "on",
                    "--max-length", "2048", "--graph-max-length", "512",
                    "--max-batch-tokens", "512", "--batch-layout", "padded"),
    ) as server:
        yield server


def test_a_packed_worker_reports_its_policy_and_the_front_caps_in_flight_by_it() -> None:
    """The packed layout (the default) with `--max-batch 3`: the flag reaches the worker, which
    builds one shape per total-token bucket and reports its policy; the front's cap is 3. A
    server without `--max-batch` takes the worker's own figure (8 on CPU)."""
    from clef_worker.serving.gpu.packed_graphs import packed_buckets

    args = ("--model", str(TINY_SNAPSHOT), "--device", "cpu", "--cuda-graphs", "on",
            "--max-length", "2048", "--graph-max-length", "512", "--max-batch-tokens", "512")
    with Serve(real_worker=True, startup_wait=240, max_batch=3, front_args=args) as server:
        health = server.health().json()
        worker = health["worker"]
        assert (worker["batch_layout"], worker["max_batch_tokens"], worker["max_sequences"]) == \
            ("packed", 512, 3)
        assert worker["buckets"] == list(packed_buckets(512, 2048, 512))
        assert worker["graph_shapes"] == [[1, t] for t in worker["buckets"]]
        assert worker["shapes"] == len(worker["buckets"])
        assert [w["max_batch"] for w in health["workers"]] == [3]
        for name in ("invoice", "twelve_questions"):
            response = server.post(json.dumps(CASES[name]["request"]).encode())
            assert response.status == 200, response.body
            assert_same_response(response.body, json.dumps(CASES[name]["response"]).encode())
    with Serve(real_worker=True, startup_wait=240, max_batch=None, front_args=args) as server:
        health = server.health().json()
        assert health["worker"]["max_sequences"] == 8
        assert [w["max_batch"] for w in health["workers"]] == [8]


def test_health_reports_the_buckets_built_at_warm_up(serve: Serve) -> None:
    worker = serve.health().json()["worker"]
    assert worker["cuda_graphs"] is False  # CPU: the buckets run eagerly
    assert worker["buckets"] == [length for length in bucket_lengths(2048) if length <= 512]
    assert len(worker["buckets"]) == 8
    # one row at every bucket, and 2, 4 and 8 rows where rows x tokens fits 512 tokens
    shapes = [[1, t] for t in worker["buckets"]] + [[2, t] for t in (64, 128, 192, 256)] + \
        [[4, 64], [4, 128], [8, 64]]
    assert worker["graph_shapes"] == sorted(shapes)
    assert worker["shapes"] == len(shapes)
    assert worker["captured_shapes"] == []  # built eagerly: nothing recorded
    assert worker["graph_memory_bytes"] == 0


@pytest.mark.parametrize("name", ["invoice", "twelve_questions"])  # 364 and 1,339 tokens
def test_golden_answers_in_and_above_the_buckets(serve: Serve, name: str) -> None:
    response = serve.post(json.dumps(CASES[name]["request"]).encode())
    assert response.status == 200, response.body
    assert_same_response(response.body, json.dumps(CASES[name]["response"]).encode())

"""Media parity: every case of tests/fixtures/clef-tiny.media.golden.jsonl through the native
executor in float32 on CPU (the rules of tests/fixtures/README.md and docs/model.md, "Media"):
token ids, media grids, the processor's pixels (sha256), rotary positions, logits within 1e-4,
bodies equal; the undecodable image answered 422."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchlib.executors import with_limits
from benchlib.golden import (
    MEDIA_GOLDEN,
    Drift,
    answered,
    assert_response_matches,
    load_cases,
    refused,
)
from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits
from clef_worker.assembly import assemble_snapshot
from clef_worker.media.vision import rope_positions
from clef_worker.native import NativeExecutor, Scored

CASES = load_cases(MEDIA_GOLDEN)
SUCCESS = answered(MEDIA_GOLDEN)
WITH_MEDIA = [case for case in SUCCESS if "media" in case]
ERRORS = refused(MEDIA_GOLDEN)


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", limits=RequestLimits())


_SCORED: dict[str, Scored] = {}


def _for_case(executor: NativeExecutor, case: dict[str, Any]) -> NativeExecutor:
    return with_limits(executor, dataclasses.replace(executor.limits,
                                                    max_length=case["max_length"]))


def _scored(executor: NativeExecutor, case: dict[str, Any]) -> Scored:
    if case["name"] not in _SCORED:
        _SCORED[case["name"]] = _for_case(executor, case).score(case["request"])
    return _SCORED[case["name"]]


def test_media_golden_file_present(executor: NativeExecutor) -> None:
    assert len(CASES) == 10, f"expected 10 media golden cases in {MEDIA_GOLDEN}"
    assert executor.vision is not None, "the tiny snapshot has a vision tower and a processor"


@pytest.mark.parametrize("case", SUCCESS, ids=[case["name"] for case in SUCCESS])
def test_tokens_spans_and_logits(executor: NativeExecutor, case: dict[str, Any]) -> None:
    scored = _scored(executor, case)
    assert scored.encoding.input_ids == case["input_ids"]
    for encoded, golden in zip(scored.encoding.questions, case["questions"], strict=True):
        assert list(encoded.question_span) == golden["question_span"]
        assert [list(span) for span in encoded.option_spans] == golden["option_spans"]
        assert list(encoded.option_ids) == golden["option_ids"]
    drift = Drift()
    drift.add(case, scored.logits, scored.probabilities)
    assert drift.within_tolerance, (case["name"], drift)


@pytest.mark.parametrize("case", WITH_MEDIA, ids=[case["name"] for case in WITH_MEDIA])
def test_media_tokens_grids_and_pixels(executor: NativeExecutor, case: dict[str, Any]) -> None:
    scored = _scored(executor, case)
    media, golden = scored.media, case["media"]
    assert media is not None
    offset = golden["token_offset"]
    assert list(media.token_ids) == case["input_ids"][offset:offset + golden["token_count"]]
    kind = "image" if "image_grid_thw" in golden else "video"
    grids = media.image_grids if kind == "image" else media.video_grids
    assert [list(grid) for grid in grids] == golden[f"{kind}_grid_thw"]
    rows = media.image_rows if kind == "image" else media.video_rows
    assert rows is not None and rows.dtype == torch.float32
    pixels = golden["pixel_values" if kind == "image" else "pixel_values_videos"]
    assert list(rows.shape) == pixels["shape"]
    assert hashlib.sha256(rows.numpy().tobytes()).hexdigest() == pixels["sha256"]


@pytest.mark.parametrize("case", WITH_MEDIA, ids=[case["name"] for case in WITH_MEDIA])
def test_rotary_positions(executor: NativeExecutor, case: dict[str, Any]) -> None:
    scored = _scored(executor, case)
    vision = executor.vision
    assert vision is not None and scored.media is not None
    positions = rope_positions(scored.encoding.input_ids, scored.media.blocks,
                               (vision.image_token, vision.video_token), vision.merge)
    assert positions.tolist() == case["media"]["rope_position_ids"]
    delta = int(positions.max()) + 1 - positions.shape[1]
    assert delta == case["media"]["rope_delta"]


@pytest.mark.parametrize("case", SUCCESS, ids=[case["name"] for case in SUCCESS])
def test_response_body(executor: NativeExecutor, case: dict[str, Any]) -> None:
    answer = _for_case(executor, case).answer(json.dumps(case["request"]).encode("utf-8"))
    assert answer.input_tokens == len(case["input_ids"])  # media tokens included
    assert_response_matches(json.loads(answer.body), case["response"],
                            list(_scored(executor, case).probabilities))


@pytest.mark.parametrize("case", ERRORS, ids=[case["name"] for case in ERRORS])
def test_media_error_rows_are_422(executor: NativeExecutor, case: dict[str, Any]) -> None:
    """`"media": true` rows carry a decoder's internal text; a clear detail of our own matches."""
    assert case["error"].get("media") is True
    with pytest.raises(RequestInvalid, match=r"^images\[0\]: the data is not a decodable"):
        _for_case(executor, case).answer(json.dumps(case["request"]).encode("utf-8"))


def test_media_tokens_count_in_the_budget(executor: NativeExecutor) -> None:
    case = next(case for case in WITH_MEDIA if case["name"] == "m_png_100x30")
    media_tokens = case["media"]["token_count"]
    fixed = len(case["input_ids"]) - _scored(executor, case).encoding.state_tokens
    # Exactly the fixed part fits: the state is cut to nothing, the sequence still scores.
    tight = dataclasses.replace(executor.limits, max_length=fixed)
    scored = with_limits(executor, tight).score(case["request"])
    assert scored.encoding.state_tokens == 0 and scored.encoding.length == fixed
    # One token less and the request is refused, the media counted in n.
    short = dataclasses.replace(executor.limits, max_length=fixed - 1)
    with pytest.raises(RequestInvalid) as refused:
        with_limits(executor, short).score(case["request"])
    assert str(refused.value) == f"schema requires {fixed} tokens before state; maximum is " \
        f"{fixed - 1}"
    assert media_tokens > 0


def test_image_warm_up_runs(executor: NativeExecutor) -> None:
    from clef_worker.starting import warmup

    scored = executor.score(warmup.with_image(warmup.REPRESENTATIVE))
    assert scored.media is not None and scored.media.image_grids == ((1, 16, 16),)


def test_warm_up_includes_an_image_request(executor: NativeExecutor,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    with_media: list[bool] = []
    real = executor.runner.run

    def spy(encodings: Any, medias: Any = (), *rest: Any, **named: Any) -> Any:
        with_media.append(any(media is not None for media in medias))
        # rest: the variants' slots, where given; named: the prefix-cache keys of its step
        return real(encodings, medias, *rest, **named)

    monkeypatch.setattr(executor.runner, "run", spy)
    executor.warm_up()
    assert True in with_media and False in with_media  # a text forward and an image forward


def test_images_and_an_odd_video_together(executor: NativeExecutor) -> None:
    """Beyond the golden cases: two images of different sizes and a 3-frame video (its last
    frame repeated to fill the pair, as the processor does) in one request. Every pad token gets
    one vision feature (the scatter checks the counts) and the layout is the release's."""
    from clef_protocol.media import gradient_image, png_data_uri

    vision = executor.vision
    assert vision is not None
    frames = [png_data_uri(gradient_image(64, 64)[:, :, ::-1].copy()) for _ in range(3)]
    request = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}},
               "images": [png_data_uri(gradient_image(64, 64)),
                          png_data_uri(gradient_image(100, 30))],
               "videos": [[frames]], "media_kwargs": {"do_sample_frames": False}}
    scored = executor.score(request)
    media = scored.media
    assert media is not None
    assert media.image_grids == ((1, 4, 4), (1, 8, 4)) and media.video_grids == ((2, 4, 4),)
    ids = list(media.token_ids)
    assert ids.count(vision.image_token) == 4 + 8 and ids.count(vision.video_token) == 2 * 4
    text = vision.encoder.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<0.0 seconds>" in text and "<0.1 seconds>" in text  # pairs (0, 1) and (2, 2)
    assert vision._timestamps(3) == [0.5 / 24, 2 / 24]
    assert all(value == value for value in scored.logits)  # no NaN

"""`--media auto|on|off` and the media flags: which snapshots load a vision tower, what a request
with media gets when there is none, and the flags reaching both processes."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import MEDIA_DISABLED, gradient_image, png_data_uri
from clef_protocol.options import RequestLimits, add_model_arguments, limits_from, worker_argv
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import StartupError
from clef_worker.media.pixels import PROCESSOR_CONFIG
from clef_worker.native import NO_VISION, NativeExecutor

IMAGE_REQUEST = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}},
                 "images": [png_data_uri(gradient_image(40, 40))]}
TEXT_REQUEST = {"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}}


@pytest.fixture(scope="module")
def text_only_snapshot(tiny_snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny snapshot without its processor: it cannot prepare pixels."""
    copy = tmp_path_factory.mktemp("no-processor") / "snapshot"
    shutil.copytree(tiny_snapshot, copy)
    (copy / PROCESSOR_CONFIG).unlink()
    return copy


def _load(snapshot: Path, media: str, limits: RequestLimits | None = None) -> NativeExecutor:
    return assemble_snapshot(snapshot, device="cpu", dtype="float32", media=media,
                               limits=limits or RequestLimits())


def test_media_on_needs_a_processor(text_only_snapshot: Path) -> None:
    with pytest.raises(StartupError, match=f"--media on: .*there is no {PROCESSOR_CONFIG}"):
        _load(text_only_snapshot, "on")


def test_media_auto_without_a_processor_scores_text_and_refuses_images(
    text_only_snapshot: Path,
) -> None:
    executor = _load(text_only_snapshot, "auto")
    assert executor.vision is None
    assert json.loads(executor.answer(json.dumps(TEXT_REQUEST).encode()).body)["answers"]
    with pytest.raises(RequestInvalid) as refused:
        executor.answer(json.dumps(IMAGE_REQUEST).encode())
    assert str(refused.value) == NO_VISION


def test_media_off_loads_no_tower_and_refuses(tiny_snapshot: Path) -> None:
    executor = _load(tiny_snapshot, "off", RequestLimits(media=False))
    assert executor.vision is None
    with pytest.raises(RequestInvalid) as refused:
        executor.answer(json.dumps(IMAGE_REQUEST).encode())
    assert str(refused.value) == MEDIA_DISABLED


def test_media_flags_reach_the_limits_and_the_worker() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--media", "off", "--max-images", "2", "--max-video-frames", "9",
                              "--max-image-pixels", "1000"])
    assert limits_from(args) == RequestLimits(media=False, max_images=2, max_video_frames=9,
                                              max_image_pixels=1000)
    again = parser.parse_args(worker_argv(args))
    assert limits_from(again) == limits_from(args) and again.media == "off"
    defaults = limits_from(parser.parse_args([]))
    assert (defaults.media, defaults.max_images, defaults.max_video_frames,
            defaults.max_image_pixels) == (True, 4, 32, 4096 * 4096)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-images", "0"])

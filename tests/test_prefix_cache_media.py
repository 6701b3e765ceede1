"""Media requests through the prefix cache: keyed by their pixels' digest too, reused only past
their media tokens (so a reuse never runs the vision tower), the text after the media continuing
the multimodal rotary positions; every answer and hidden state equal to the uncached forward."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from clef_protocol.media import gradient_image, png_data_uri
from clef_worker.assembly import assemble_snapshot
from clef_worker.media.vision import VisionTower
from clef_worker.native import NativeExecutor, Prepared
from clef_worker.serving.prefix.cache import CacheKey, PrefixCache, ids_array, root_key
from clef_worker.serving.staging import RunOutput

BOUND = 1.5e-4  # the golden bound (fp32 on CPU)
QUESTIONS = {"decide": {"type": "choice", "criteria": {"a": "approve", "b": "block"}}}
# The tiny processor's largest image (65,536 pixels): 64 media tokens whose rotary positions
# advance by 8, so text after it sits 56 positions before its token index.
PICTURE = gradient_image(256, 256)
OTHER_PICTURE = np.ascontiguousarray(PICTURE[::-1])  # same size, so the same token ids


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    """The worker's defaults on CPU (prefix cache on)."""
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32")


@pytest.fixture
def cache(executor: NativeExecutor) -> PrefixCache:
    found = executor.runner.prefix_cache
    assert found is not None and found.enabled  # on by default
    found.reset()
    return found


def _prepared(executor: NativeExecutor, events: int, picture: np.ndarray = PICTURE,
              video: bool = False) -> Prepared:
    """A media request about `picture` (or a four-frame video of it) with `events` events."""
    state = {"events": [{"n": i, "note": f"screen {i}: invoice {i * 37} paid by {i % 11}"}
                        for i in range(events)]}
    body: dict[str, Any] = {"model": "clef-flash", "state": state, "questions": QUESTIONS}
    if video:
        frames = [png_data_uri(np.ascontiguousarray(np.roll(picture[:128, :128], shift, 1)))
                  for shift in range(0, 64, 16)]
        body.update(videos=[[frames]], media_kwargs={"do_sample_frames": False})
    else:
        body["images"] = [png_data_uri(picture)]
    return executor.prepare(json.dumps(body).encode())


def _cached(executor: NativeExecutor, prepared: Prepared) -> RunOutput:
    """Through the prefix cache, as the serve loop runs it."""
    return executor.runner.run_staged(executor.stage([prepared])[1], keep_hidden=True)


def _uncached(executor: NativeExecutor, prepared: Prepared) -> RunOutput:
    """The plain vision path (no cache keys: the cache is not used)."""
    return executor.runner.run([prepared.encoding], [prepared.media], [prepared.slot],
                               keep_hidden=True)


def _assert_equal(got: RunOutput, want: RunOutput) -> None:
    assert got.hidden is not None and want.hidden is not None
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    difference = max(abs(a - b) for a, b in zip(got.rows[0].probabilities,
                                                want.rows[0].probabilities, strict=True))
    assert difference <= BOUND


def _media_end(executor: NativeExecutor, prepared: Prepared) -> int:
    assert prepared.media is not None
    return len(executor.encoder.prefix_ids) + len(prepared.media.token_ids)


def test_a_media_prefix_plus_its_text_suffix_equals_the_whole_forward(
        executor: NativeExecutor, cache: PrefixCache) -> None:
    """The first turn runs from nothing through the prefixed forward (tower embeddings, 3D
    positions) and stores; the grown turn reuses past the media and continues the positions."""
    first = _prepared(executor, 16)
    stored = _cached(executor, first)
    assert stored.rows[0].reused_tokens == 0 and cache.blocks
    _assert_equal(stored, _uncached(executor, first))
    media_end = _media_end(executor, first)
    assert all(block.end >= media_end for block in cache.blocks.values())
    # Text after the image lags its token index: 64 tokens, 8 positions.
    assert {block.rope_delta for block in cache.blocks.values()} == {8 - 64}

    grown = _prepared(executor, 20)
    reused = _cached(executor, grown)
    assert reused.rows[0].reused_tokens >= media_end
    _assert_equal(reused, _uncached(executor, grown))
    assert cache.hits == 1 and cache.tokens_reused == reused.rows[0].reused_tokens


def test_a_video_prefix_plus_its_text_suffix_equals_the_whole_forward(
        executor: NativeExecutor, cache: PrefixCache) -> None:
    """A video: several blocks of pads with timestamps between them; the text after the last
    continues one past the largest position."""
    first = _prepared(executor, 16, video=True)
    assert first.media is not None and first.media.video_grids
    _assert_equal(_cached(executor, first), _uncached(executor, first))
    grown = _prepared(executor, 20, video=True)
    reused = _cached(executor, grown)
    assert reused.rows[0].reused_tokens >= _media_end(executor, grown)
    _assert_equal(reused, _uncached(executor, grown))
    assert all(block.rope_delta < 0 for block in cache.blocks.values())


def test_the_same_pixels_sent_again_another_way_have_the_same_digest(
        executor: NativeExecutor, tiny_snapshot: Path) -> None:
    """The key follows the pixels, not how the client encoded them."""
    buffer = io.BytesIO()
    Image.fromarray(PICTURE).save(buffer, format="PNG", compress_level=1)
    again = {"content_type": "image/png", "base64": base64.b64encode(buffer.getvalue()).decode()}
    assert png_data_uri(PICTURE).split(",", 1)[1] != again["base64"]
    bodies = [{"model": "clef-flash", "state": "s", "questions": QUESTIONS, "images": [image]}
              for image in (png_data_uri(PICTURE), again)]
    digests = [executor.prepare(json.dumps(body).encode()).media for body in bodies]
    assert digests[0] is not None and digests[1] is not None
    assert digests[0].digest == digests[1].digest != ""
    # A worker with the cache off never keys anything: the pixels are not hashed.
    off = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", prefix_cache="off")
    uncached = off.prepare(json.dumps(bodies[0]).encode()).media
    assert uncached is not None and uncached.digest == ""


def test_the_recorded_rotary_offset_is_what_makes_the_suffix_right(
        executor: NativeExecutor, cache: PrefixCache) -> None:
    """Without the media's rotary offset the suffix would sit 56 positions late: the
    comparison above can fail."""
    _cached(executor, _prepared(executor, 16))
    for block in cache.blocks.values():
        block.rope_delta = 0
    grown = _prepared(executor, 20)
    wrong = _cached(executor, grown)
    want = _uncached(executor, grown)
    assert wrong.rows[0].reused_tokens > 0 and wrong.hidden is not None
    assert want.hidden is not None
    assert (wrong.hidden - want.hidden).abs().max() > 1e-3


def test_two_pictures_with_the_same_tokens_never_share_states(
        executor: NativeExecutor, cache: PrefixCache) -> None:
    one, other = _prepared(executor, 16), _prepared(executor, 16, OTHER_PICTURE)
    assert one.encoding.input_ids == other.encoding.input_ids  # only the digest tells them apart
    assert one.media is not None and other.media is not None
    assert one.media.digest != other.media.digest
    _cached(executor, one)
    missed = _cached(executor, other)
    assert missed.rows[0].reused_tokens == 0 and cache.hits == 0
    _assert_equal(missed, _uncached(executor, other))
    # Each picture finds its own states again.
    assert _cached(executor, _prepared(executor, 16, OTHER_PICTURE)).rows[0].reused_tokens > 0
    assert _cached(executor, _prepared(executor, 16)).rows[0].reused_tokens > 0
    # And a text request with the same state is another chain again.
    text = executor.cache_key(executor.prepare(json.dumps(
        {"model": "clef-flash", "state": {"events": []}, "questions": QUESTIONS}).encode()))
    media = executor.cache_key(one)
    assert text is not None and media is not None and text.root != media.root
    assert (text.media_end, media.media_end) == (0, _media_end(executor, one))


def test_a_reused_media_prefix_does_not_run_the_vision_tower(
        executor: NativeExecutor, cache: PrefixCache, monkeypatch: pytest.MonkeyPatch) -> None:
    vision = executor.runner.vision
    assert vision is not None
    calls: list[int] = []
    original = VisionTower.embeddings

    def counted(self: VisionTower, *args: Any) -> Any:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(VisionTower, "embeddings", counted)
    _cached(executor, _prepared(executor, 16))
    assert len(calls) == 1
    again = _cached(executor, _prepared(executor, 24))
    assert again.rows[0].reused_tokens > 0 and len(calls) == 1
    # Another picture is read by the tower.
    _cached(executor, _prepared(executor, 24, OTHER_PICTURE))
    assert len(calls) == 2


def test_no_point_inside_the_media_is_stored_or_reused() -> None:
    cache = PrefixCache(1 << 30)
    assert cache.points(0, 700) == (256, 512, 640)
    assert cache.points(0, 700, media_end=300) == (512, 640)
    assert cache.points(0, 700, media_end=641) == ()
    # A chain that ends inside the media (stored by hand here: the cache never stores one) is
    # not reused.
    root = root_key("0:", "digest")
    ids = ids_array(range(800))
    hit = cache.lookup(CacheKey(root, 300), ids)
    points = cache.points(0, 300)
    assert points == (256,)
    cache.store(CacheKey(root, 300), ids, hit, _captured(points, 800), torch.zeros(800, 8))
    assert cache.lookup(CacheKey(root, 300), ids).tokens == 256
    assert cache.lookup(CacheKey(root, 700, media_end=300), ids).tokens == 0


def _captured(points: tuple[int, ...], new: int) -> Any:
    from clef_worker.model.prefix_forward import Captured

    return Captured(points, [[torch.zeros(2, 4, 4)] for _ in points],
                    [[torch.zeros(3, 8)] for _ in points],
                    [torch.zeros(1, new, 4)], [torch.zeros(1, new, 4)], [0] * len(points))

"""Media inputs: what is accepted and every refusal (422 detail), checked without a model.

Nothing is ever fetched or opened: a URL is refused while a local listener proves no connection
arrived and socket connects are trapped; a path to a real image file is refused; a small file
declaring a huge image is refused from its header, before any pixel is decoded.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageFile

from clef_protocol.errors import RequestInvalid
from clef_protocol.media import check_media, decode_media, gradient_image, png_data_uri
from clef_protocol.options import RequestLimits
from clef_protocol.validation import validate_request

LIMITS = RequestLimits()
QUESTIONS = {"q": {"type": "noul"}}


def request(**media: Any) -> dict[str, Any]:
    return {"model": "m", "state": "s", "questions": QUESTIONS, **media}


def refusal(body: dict[str, Any], limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(RequestInvalid) as refused:
        validate_request(body, limits)
    return str(refused.value)


def encoded(image: Image.Image, fmt: str, **save: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


PICTURE = Image.fromarray(gradient_image(20, 30))
PNG = encoded(PICTURE, "PNG")


def png_declaring(width: int, height: int) -> str:
    """A valid-looking PNG of a few dozen bytes whose header declares width x height."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))
    return base64.b64encode(data).decode("ascii")


# -- accepted ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,content_type", [("PNG", "png"), ("JPEG", "jpeg"),
                                              ("WEBP", "webp"), ("GIF", "gif")])
def test_each_format_in_each_spelling(fmt: str, content_type: str) -> None:
    data = encoded(PICTURE.convert("RGB"), fmt)
    for entry in (f"data:image/{content_type};base64,{data}", data,
                  {"content_type": f"image/{content_type}", "base64": data}):
        decoded = decode_media(request(images=[entry]), LIMITS)
        assert len(decoded.images) == 1
        assert decoded.images[0].shape == (20, 30, 3) and decoded.images[0].dtype == np.uint8


def test_png_pixels_are_exact_and_alpha_is_dropped() -> None:
    pixels = gradient_image(20, 30)
    alpha = np.full((20, 30, 1), 7, dtype=np.uint8)  # nearly transparent: blending would show
    rgba = Image.fromarray(np.concatenate([pixels, alpha], axis=2), mode="RGBA")
    decoded = decode_media(request(images=[encoded(rgba, "PNG")]), LIMITS)
    assert np.array_equal(decoded.images[0], pixels)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encoded(PICTURE.convert("RGB"), "JPEG", exif=exif.tobytes())
    decoded = decode_media(request(images=[data]), LIMITS)
    assert decoded.images[0].shape == (30, 20, 3)


def test_multi_picture_jpeg_is_its_first_picture() -> None:
    """MPO (a JPEG with extra pictures, as phone cameras write) is a photo, not an animation."""
    first = Image.fromarray(gradient_image(20, 30))
    data = encoded(first, "MPO", save_all=True, append_images=[Image.new("RGB", (30, 20))])
    decoded = decode_media(request(images=[data]), LIMITS)
    assert decoded.images[0].shape == (20, 30, 3) and int(decoded.images[0].max()) > 0


def test_base64_with_line_breaks_is_accepted() -> None:
    wrapped = "\n".join(PNG[i:i + 76] for i in range(0, len(PNG), 76))
    check_media(request(images=[wrapped]), LIMITS)


@pytest.mark.parametrize("media", [{"images": []}, {"images": None}, {"videos": []},
                                   {"images": [], "videos": None, "media_kwargs": {}}])
def test_empty_media_is_text_only(media: dict[str, Any]) -> None:
    validate_request(request(**media), LIMITS)
    assert decode_media(request(**media), LIMITS).empty


def test_video_frames() -> None:
    frames = [png_data_uri(gradient_image(16, 16)) for _ in range(3)]
    decoded = decode_media(request(videos=[[frames]],
                                   media_kwargs={"do_sample_frames": False}), LIMITS)
    assert len(decoded.videos) == 1 and len(decoded.videos[0]) == 3


# -- refused, never fetched or opened --------------------------------------------------------


@pytest.fixture
def no_connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    attempts: list[Any] = []

    def trap(*args: Any, **kwargs: Any) -> Any:
        attempts.append(args)
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", trap)
    monkeypatch.setattr(socket.socket, "connect_ex", trap)
    monkeypatch.setattr(socket, "create_connection", trap)
    monkeypatch.setattr(socket, "getaddrinfo", trap)
    return attempts


@pytest.mark.parametrize("scheme", ["http", "https", "ftp", "file"])
def test_url_is_refused_and_never_fetched(scheme: str, no_connections: list[Any]) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for entry in (f"{scheme}://127.0.0.1:{port}/cat.png",
                      {"content_type": "image/png", "base64": f"http://127.0.0.1:{port}/x"}):
            detail = refusal(request(images=[entry]))
            assert "images[0]" in detail and ("URL" in detail or "base64" in detail), detail
            with pytest.raises(RequestInvalid):
                decode_media(request(images=[entry]), LIMITS)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()
    assert no_connections == []


def test_file_path_is_refused_and_never_opened(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    picture = tmp_path / "cat.png"
    PICTURE.save(picture)
    opened: list[Any] = []
    real_open = Image.open
    def spy_open(fp: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(fp)
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", spy_open)
    for entry in (str(picture), f"file://{picture}", "./cat.png", "C:\\images\\cat.png"):
        detail = refusal(request(images=[entry]))
        assert detail.startswith("images[0]: "), detail
    assert all(isinstance(fp, io.BytesIO) for fp in opened)  # only ever in-memory bytes


@pytest.mark.parametrize("images,detail", [
    (PNG, "images must be an array of images, not one string"),
    ({"0": PNG}, "images must be an array of images"),
    ([3], "images[0]: an image must be a base64 string, a data URI or an object with "
          "content_type and base64, not a number"),
    ([None], "images[0]: an image must be a base64 string, a data URI or an object with "
             "content_type and base64, not null"),
    ([[PNG]], "images[0]: an image must be a base64 string, a data URI or an object with "
              "content_type and base64, not an array"),
    ([{"url": "x"}], 'images[0]: an image object must be {"content_type": "image/...", '
                     '"base64": "..."}'),
    ([""], "images[0]: the image data is empty"),
    (["data:image/png," + PNG], "images[0]: a data URI must be data:image/<type>;base64,<data>"),
    (["data:image/svg+xml;base64,PHN2Zz4="],
     "images[0]: unsupported image type image/svg+xml; expected image/png, image/jpeg, "
     "image/webp or image/gif"),
    ([PNG[:-3]], "images[0]: not valid base64 image data (URLs and file paths are never "
                 "opened; send the image inline)"),
    (["R0lGODlhIGJ1dCBub3QgcmVhbGx5IGEgcGljdHVyZQ=="],
     "images[0]: the data is not a decodable PNG, JPEG, WebP or GIF image"),
])
def test_malformed_images(images: Any, detail: str) -> None:
    assert refusal(request(images=images)) == detail


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_other_formats_are_refused(fmt: str) -> None:
    assert refusal(request(images=[encoded(PICTURE.convert("RGB"), fmt)])) == (
        "images[0]: the data is not a decodable PNG, JPEG, WebP or GIF image"
    )


def test_truncated_image_is_refused_when_decoded() -> None:
    data = base64.b64decode(encoded(Image.fromarray(gradient_image(64, 64)), "PNG"))
    truncated = base64.b64encode(data[: len(data) // 2]).decode()
    with pytest.raises(RequestInvalid, match="not a decodable"):
        decode_media(request(images=[truncated]), LIMITS)


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_are_refused(fmt: str) -> None:
    frames = [Image.fromarray(gradient_image(16, 16)), Image.new("RGB", (16, 16), "red")]
    data = encoded(frames[0], fmt, save_all=True, append_images=frames[1:])
    assert refusal(request(images=[data])) == (
        "images[0]: animated images are not accepted; send one frame"
    )


@pytest.mark.parametrize("width,height", [(100_000, 100_000), (5000, 4000)])
def test_decompression_bomb_is_refused_from_its_header(
    width: int, height: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    bomb = png_declaring(width, height)
    assert len(bomb) < 200
    decoded: list[Any] = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self))
    detail = refusal(request(images=[bomb]))
    assert detail.startswith("images[0]: the image is too large"), detail
    assert "maximum is 16,777,216 pixels (--max-image-pixels)" in detail
    with pytest.raises(RequestInvalid, match="too large"):
        decode_media(request(images=[bomb]), LIMITS)
    assert decoded == []  # refused before any pixel was decoded
    with pytest.raises(RequestInvalid):  # the trap does catch decoding: a fine image hits it
        decode_media(request(images=[PNG]), LIMITS)
    assert decoded


def test_max_image_pixels_flag() -> None:
    limits = RequestLimits(max_image_pixels=20 * 30 - 1)
    assert refusal(request(images=[PNG]), limits) == (
        "images[0]: the image is too large (30x20 = 600 pixels); maximum is 599 pixels "
        "(--max-image-pixels)"
    )
    validate_request(request(images=[PNG]), RequestLimits(max_image_pixels=600))


def test_max_images() -> None:
    assert refusal(request(images=[PNG] * 5)) == "5 images; maximum is 4 (--max-images)"
    validate_request(request(images=[PNG] * 4), LIMITS)
    assert refusal(request(images=[PNG] * 2), RequestLimits(max_images=1)) == (
        "2 images; maximum is 1 (--max-images)"
    )


def test_max_video_frames() -> None:
    kwargs = {"do_sample_frames": False}
    videos = [[[PNG] * 3], [[PNG] * 3]]
    assert refusal(request(videos=videos, media_kwargs=kwargs),
                   RequestLimits(max_video_frames=5)) == (
        "6 video frames; maximum is 5 (--max-video-frames)"
    )
    validate_request(request(videos=videos, media_kwargs=kwargs), RequestLimits(max_video_frames=6))


@pytest.mark.parametrize("videos,kwargs,detail", [
    ([PNG], {"do_sample_frames": False},
     "videos[0]: a video must be given as its frames, [[frame, frame, ...]], not as one string "
     "(video files and URLs are not accepted)"),
    (PNG, {"do_sample_frames": False},
     "videos must be an array of videos, each [[frame, frame, ...]]"),
    ([[PNG, PNG]], {"do_sample_frames": False},
     "videos[0]: a video must be written [[frame, frame, ...]]"),
    ([[[PNG]]], {"do_sample_frames": False}, "videos[0]: a video needs at least 2 frames, got 1"),
    ([[[PNG, PNG]]], None, 'videos need "media_kwargs": {"do_sample_frames": false} (frames are '
                           'given, not sampled)'),
    ([[[PNG, PNG]]], {"do_sample_frames": True}, 'videos need "media_kwargs": '
                                                 '{"do_sample_frames": false} (frames are given, '
                                                 'not sampled)'),
    ([[[PNG, png_data_uri(gradient_image(8, 8))]]], {"do_sample_frames": False},
     "videos[0][0][1]: every frame of a video must have the same size; this one is 8x8, the "
     "first is 30x20"),
    ([[["https://example.com/a.png", PNG]]], {"do_sample_frames": False},
     "videos[0][0][0]: URLs are not fetched; send the image inline as base64 or a data URI"),
])
def test_malformed_videos(videos: Any, kwargs: Any, detail: str) -> None:
    body = request(videos=videos) if kwargs is None else request(videos=videos,
                                                                  media_kwargs=kwargs)
    assert refusal(body) == detail


@pytest.mark.parametrize("kwargs,detail", [
    ({"size": {"longest_edge": 10**9}},
     "media_kwargs.size is not accepted; only do_sample_frames may be given"),
    ({"do_sample_frames": False, "fps": 30},
     "media_kwargs.fps is not accepted; only do_sample_frames may be given"),
    ("fast", "media_kwargs must be an object"),
    ({"do_sample_frames": "no"}, "media_kwargs.do_sample_frames must be true or false"),
])
def test_media_kwargs(kwargs: Any, detail: str) -> None:
    assert refusal(request(images=[PNG], media_kwargs=kwargs)) == detail


def test_media_off() -> None:
    off = RequestLimits(media=False)
    assert refusal(request(images=[PNG]), off) == (
        "images and videos are disabled on this server (--media off)"
    )
    validate_request(request(images=[]), off)


def test_media_checked_after_the_reference_checks() -> None:
    assert refusal({"model": "m", "state": "s", "questions": {}, "images": "x"}) == (
        "at least one question is required"
    )

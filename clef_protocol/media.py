"""Media inputs (`images`, `videos`, `media_kwargs`): what is accepted, what is refused, decoding.

Shared by the front and the worker, with Pillow and numpy only (the front never imports torch).
The rules follow docs/model.md ("Media"):

- an image is a string, either a data URI `data:image/<type>;base64,<data>` or the bare base64,
  or an object `{"content_type": "image/<type>", "base64": "<data>"}` (what clients send);
- a video is `[[frame, frame, ...]]`: one list of two or more frames, each an image as above,
  all of one size; it needs `"media_kwargs": {"do_sample_frames": false}` (frames are given,
  never sampled);
- nothing is ever fetched or opened: a URL, a file path, or anything that is not base64 is
  refused (the reference downloads URLs and reads paths that exist, a server must not);
- the format is PNG, JPEG, WebP or a single-frame GIF, and the size declared in the file's header
  is checked against `--max-image-pixels` *before* any pixel is decoded, so a small file
  declaring a huge image (a decompression bomb) costs nothing.

Two entry points: `check_media` (structure, base64, headers: cheap, no pixel decoding; run by
`validate_request` on both sides) and `decode_media` (the same checks, then the pixels as
8-bit RGB arrays, EXIF orientation applied, alpha dropped, as the reference's decoder gives them).
Every refusal is a `RequestInvalid` whose text is the 422 detail.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from clef_protocol.errors import RequestInvalid
from clef_protocol.options import RequestLimits

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
CONTENT_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
ALLOWED_MEDIA_KWARGS = ("do_sample_frames",)

MEDIA_DISABLED = "images and videos are disabled on this server (--media off)"
VIDEO_NEEDS_FRAMES = (
    'videos need "media_kwargs": {"do_sample_frames": false} (frames are given, not sampled)'
)

_DATA_URI = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.ASCII)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://", re.ASCII)
_WHITESPACE = re.compile(r"[ \t\r\n]+", re.ASCII)


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header declares, read without decoding its pixels."""

    format: str
    width: int
    height: int


@dataclass(frozen=True)
class DecodedMedia:
    """The request's media as 8-bit RGB arrays `[height, width, 3]`, in request order."""

    images: tuple[np.ndarray, ...]
    videos: tuple[tuple[np.ndarray, ...], ...]

    @property
    def empty(self) -> bool:
        return not self.images and not self.videos


def has_media(request: dict[str, Any]) -> bool:
    """Whether a request carries media at all (`[]`, `null` or no key is text-only)."""
    return any(request.get(key) not in (None, []) for key in ("images", "videos"))


# ---------------------------------------------------------------------------------------------
# Structure: which entries are images and frames, refusing everything that would be fetched


def _image_entries(request: dict[str, Any]) -> list[tuple[str, Any]]:
    images = request.get("images")
    if images is None:
        return []
    if isinstance(images, str):
        raise RequestInvalid("images must be an array of images, not one string")
    if not isinstance(images, list):
        raise RequestInvalid("images must be an array of images")
    return [(f"images[{index}]", entry) for index, entry in enumerate(images)]


def _video_entries(request: dict[str, Any]) -> list[list[tuple[str, Any]]]:
    videos = request.get("videos")
    if videos is None:
        return []
    if not isinstance(videos, list):
        raise RequestInvalid("videos must be an array of videos, each [[frame, frame, ...]]")
    result: list[list[tuple[str, Any]]] = []
    for index, video in enumerate(videos):
        where = f"videos[{index}]"
        if isinstance(video, str):
            raise RequestInvalid(
                f"{where}: a video must be given as its frames, [[frame, frame, ...]], not as "
                "one string (video files and URLs are not accepted)"
            )
        if not (isinstance(video, list) and len(video) == 1 and isinstance(video[0], list)):
            raise RequestInvalid(f"{where}: a video must be written [[frame, frame, ...]]")
        frames = video[0]
        if len(frames) < 2:
            raise RequestInvalid(f"{where}: a video needs at least 2 frames, got {len(frames)}")
        result.append([(f"{where}[0][{number}]", frame) for number, frame in enumerate(frames)])
    return result


def _check_media_kwargs(request: dict[str, Any], has_videos: bool) -> None:
    kwargs = request.get("media_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise RequestInvalid("media_kwargs must be an object")
    unknown = [key for key in kwargs if key not in ALLOWED_MEDIA_KWARGS]
    if unknown:
        raise RequestInvalid(
            f"media_kwargs.{unknown[0]} is not accepted; only do_sample_frames may be given"
        )
    sample = kwargs.get("do_sample_frames")
    if sample is not None and not isinstance(sample, bool):
        raise RequestInvalid("media_kwargs.do_sample_frames must be true or false")
    if has_videos and sample is not False:
        raise RequestInvalid(VIDEO_NEEDS_FRAMES)


def _image_bytes(where: str, entry: Any) -> bytes:
    """The raw bytes of one image entry; refuses anything that is not inline base64 data."""
    declared: str | None = None
    if isinstance(entry, dict):
        content_type = entry.get("content_type")
        data = entry.get("base64")
        if not isinstance(content_type, str) or not isinstance(data, str) or set(entry) - {
            "content_type", "base64"
        }:
            raise RequestInvalid(
                f'{where}: an image object must be {{"content_type": "image/...", '
                '"base64": "..."}'
            )
        declared = content_type.strip().lower()
    elif isinstance(entry, str):
        data = entry
        if data[:5].lower() == "data:":
            match = _DATA_URI.match(data)
            if match is None or ";base64" not in match.group("params").lower():
                raise RequestInvalid(
                    f"{where}: a data URI must be data:image/<type>;base64,<data>"
                )
            declared = match.group("type").strip().lower()
            data = data[match.end():]
        elif _SCHEME.match(data):
            raise RequestInvalid(
                f"{where}: URLs are not fetched; send the image inline as base64 or a data URI"
            )
    else:
        raise RequestInvalid(
            f"{where}: an image must be a base64 string, a data URI or an object with "
            f"content_type and base64, not {_json_type(entry)}"
        )
    if declared is not None and declared not in CONTENT_TYPES:
        raise RequestInvalid(
            f"{where}: unsupported image type {declared or '(none)'}; expected image/png, "
            "image/jpeg, image/webp or image/gif"
        )
    if not data.strip():
        raise RequestInvalid(f"{where}: the image data is empty")
    try:
        # Strict: the whole string must be base64 (a path or a URL is not); line breaks are
        # allowed, as MIME writes them. Stripping only when needed keeps big images cheap.
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        try:
            return base64.b64decode(_WHITESPACE.sub("", data), validate=True)
        except (binascii.Error, ValueError):
            raise RequestInvalid(
                f"{where}: not valid base64 image data (URLs and file paths are never opened; "
                "send the image inline)"
            ) from None


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------
# Headers and pixels


def _open(where: str, raw: bytes, limits: RequestLimits) -> tuple[Image.Image, ImageHeader]:
    """Open lazily (Pillow reads the header only), check format, size and frame count."""
    try:
        with warnings.catch_warnings():
            # --max-image-pixels is the limit, checked below; Pillow's own error (at twice its
            # MAX_IMAGE_PIXELS, about 179 megapixels) stays a hard ceiling above it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=FORMATS)
    except Image.DecompressionBombError:
        raise RequestInvalid(_too_large(where, None, limits)) from None
    except Exception:
        raise RequestInvalid(
            f"{where}: the data is not a decodable PNG, JPEG, WebP or GIF image"
        ) from None
    header = ImageHeader(format=str(image.format), width=image.width, height=image.height)
    if header.width * header.height > limits.max_image_pixels:
        image.close()
        raise RequestInvalid(_too_large(where, header, limits))
    if header.width < 1 or header.height < 1:
        raise RequestInvalid(f"{where}: the image has no pixels")
    # MPO is a JPEG with extra pictures (phone cameras write them): its first one is the photo.
    if getattr(image, "is_animated", False) and header.format != "MPO":
        image.close()
        raise RequestInvalid(f"{where}: animated images are not accepted; send one frame")
    return image, header


def _too_large(where: str, header: ImageHeader | None, limits: RequestLimits) -> str:
    size = f" ({header.width}x{header.height} = {header.width * header.height:,} pixels)" \
        if header else ""
    return (f"{where}: the image is too large{size}; maximum is {limits.max_image_pixels:,} "
            "pixels (--max-image-pixels)")


def _pixels(where: str, image: Image.Image, limits: RequestLimits) -> np.ndarray:
    """Decode to 8-bit RGB: EXIF orientation applied, alpha dropped (not blended)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
            upright = ImageOps.exif_transpose(image) or image
            if upright.mode in ("I;16", "I;16B", "I;16L", "I"):
                wide = np.asarray(upright, dtype=np.uint32)
                gray = (wide >> 8).clip(0, 255).astype(np.uint8)
                array = np.repeat(gray[:, :, None], 3, axis=2)
            else:
                array = np.asarray(upright.convert("RGB"), dtype=np.uint8)
    except Exception:
        raise RequestInvalid(
            f"{where}: the data is not a decodable PNG, JPEG, WebP or GIF image"
        ) from None
    finally:
        image.close()
    height, width = array.shape[:2]
    if width * height > limits.max_image_pixels:
        raise RequestInvalid(_too_large(where, ImageHeader("?", width, height), limits))
    return np.ascontiguousarray(array)


# ---------------------------------------------------------------------------------------------
# Entry points


def _walk(request: dict[str, Any], limits: RequestLimits) -> tuple[
    list[tuple[str, Any]], list[list[tuple[str, Any]]]
]:
    images = _image_entries(request)
    videos = _video_entries(request)
    _check_media_kwargs(request, bool(videos))
    if not images and not videos:
        return images, videos
    if not limits.media:
        raise RequestInvalid(MEDIA_DISABLED)
    if len(images) > limits.max_images:
        raise RequestInvalid(
            f"{len(images)} images; maximum is {limits.max_images} (--max-images)"
        )
    frames = sum(len(video) for video in videos)
    if frames > limits.max_video_frames:
        raise RequestInvalid(
            f"{frames} video frames; maximum is {limits.max_video_frames} (--max-video-frames)"
        )
    return images, videos


def _opened(request: dict[str, Any], limits: RequestLimits) -> Iterator[
    tuple[int | None, str, Image.Image, ImageHeader]
]:
    """Every image and frame opened (headers checked), with its video index (None: an image).
    Frames of one video must share one size."""
    images, videos = _walk(request, limits)
    for where, entry in images:
        image, header = _open(where, _image_bytes(where, entry), limits)
        yield None, where, image, header
    for video_index, frames in enumerate(videos):
        size: tuple[int, int] | None = None
        for where, entry in frames:
            image, header = _open(where, _image_bytes(where, entry), limits)
            if size is not None and (header.width, header.height) != size:
                image.close()
                raise RequestInvalid(
                    f"{where}: every frame of a video must have the same size; this one is "
                    f"{header.width}x{header.height}, the first is {size[0]}x{size[1]}"
                )
            size = (header.width, header.height)
            yield video_index, where, image, header


def check_media(request: dict[str, Any], limits: RequestLimits) -> None:
    """Refuse (RequestInvalid) any media the server would not score; decodes no pixels."""
    for _, _, image, _ in _opened(request, limits):
        image.close()


def decode_media(request: dict[str, Any], limits: RequestLimits) -> DecodedMedia:
    """The checks of `check_media`, then every image and frame as 8-bit RGB pixels."""
    images: list[np.ndarray] = []
    videos: list[list[np.ndarray]] = []
    for video_index, where, image, _ in _opened(request, limits):
        pixels = _pixels(where, image, limits)
        if video_index is None:
            images.append(pixels)
            continue
        if video_index == len(videos):
            videos.append([])
        elif videos[video_index] and videos[video_index][0].shape != pixels.shape:
            raise RequestInvalid(f"{where}: every frame of a video must have the same size")
        videos[video_index].append(pixels)
    return DecodedMedia(images=tuple(images), videos=tuple(tuple(v) for v in videos))


# ---------------------------------------------------------------------------------------------
# Making images (warm-up, tests, benchmarks)


def png_data_uri(pixels: np.ndarray) -> str:
    """An 8-bit RGB array `[H, W, 3]` as a `data:image/png;base64,` URI."""
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def gradient_image(height: int, width: int) -> np.ndarray:
    """A deterministic test picture: colour gradients with a few hard edges."""
    rows = np.linspace(0, 255, height, dtype=np.float64)[:, None]
    cols = np.linspace(0, 255, width, dtype=np.float64)[None, :]
    red = np.broadcast_to(rows, (height, width))
    green = np.broadcast_to(cols, (height, width))
    blue = ((rows // 32 + cols // 32) % 2) * 255
    return np.stack([red, green, blue * np.ones_like(red)], axis=2).astype(np.uint8)

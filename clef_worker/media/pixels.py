"""The pixel pipeline: decoded 8-bit RGB images and frames -> the vision tower's patch rows.

It reproduces the release's processor (`processor_config.json`: Qwen2-VL image processor and
Qwen3-VL video processor, torchvision backend) with torch operations only, because torchvision
does not load beside the CPU torch wheel this project uses:

1. target size: both sides multiples of `patch_size * merge_size` (32), the pixel count within
   the processor's range, the aspect ratio kept as closely as possible (`image_target_size`,
   `video_target_size`; an aspect ratio over 200 is refused as the reference refuses it);
2. resize: antialiased bicubic on the uint8 tensor, on CPU. torchvision's `resize` hands a uint8
   CPU tensor straight to `torch.nn.functional.interpolate(..., antialias=True)` for bicubic,
   whose uint8 kernel rounds and clamps in fixed point; calling that kernel directly gives the
   reference's exact bytes (Pillow's bicubic differs by one level here and there, enough to move
   logits by 2.6e-4). An image already at its target size is left untouched, as there;
3. rescale and normalise fused, in float32: `(x - mean/scale) / (std/scale)`, as the reference's
   fused `rescale_and_normalize` computes it (bit-identical, which a sha256 over the golden
   pixels checks);
4. patchify: frames padded to a multiple of `temporal_patch_size` by repeating the last (an image
   is one frame, so it is doubled), rows ordered by merge window (`t, h/m, w/m, m, m`), each row
   `channel x temporal x patch x patch`.

Everything here runs on CPU; the rows move to the model's device afterwards.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional

from clef_protocol.errors import RequestInvalid
from clef_worker.errors import StartupError

PROCESSOR_CONFIG = "processor_config.json"
BICUBIC = 3  # PIL's resample code, which processor_config.json uses
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class PixelSettings:
    """The processor settings the pipeline needs, read once from `processor_config.json`."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float
    image_min_pixels: int
    image_max_pixels: int
    video_min_pixels: int
    video_max_pixels: int

    @property
    def factor(self) -> int:
        """Both sides of a resized image are multiples of this (one merged token's side)."""
        return self.patch_size * self.merge_size

    @property
    def row_size(self) -> int:
        """Values per patch row: channels x temporal patch x patch x patch."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_file(cls, path: Path) -> PixelSettings:
        """Read and check the processor config; StartupError says which setting is off."""
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
            image = config["image_processor"]
            video = config.get("video_processor", image)
            settings = cls(
                patch_size=int(image["patch_size"]),
                merge_size=int(image["merge_size"]),
                temporal_patch_size=int(image["temporal_patch_size"]),
                mean=_triple(image["image_mean"]),
                std=_triple(image["image_std"]),
                rescale_factor=float(image["rescale_factor"]),
                image_min_pixels=int(image["size"]["shortest_edge"]),
                image_max_pixels=int(image["size"]["longest_edge"]),
                video_min_pixels=int(video["size"]["shortest_edge"]),
                video_max_pixels=int(video["size"]["longest_edge"]),
            )
            for name, section in (("image_processor", image), ("video_processor", video)):
                _expect(section, name, "resample", BICUBIC)
                for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
                    _expect(section, name, flag, True)
                for key in ("patch_size", "merge_size", "temporal_patch_size"):
                    _expect(section, name, key, image[key])
        except StartupError:
            raise
        except Exception as exc:
            raise StartupError(f"{path}: cannot read the processor settings: {exc}") from exc
        return settings


def _triple(values: Any) -> tuple[float, float, float]:
    first, second, third = (float(value) for value in values)
    return first, second, third


def _expect(section: dict[str, Any], name: str, key: str, wanted: Any) -> None:
    found = section.get(key, wanted)
    if found != wanted:
        raise StartupError(f"{name}.{key} is {found!r}; this server implements {wanted!r}")


@dataclass(frozen=True)
class Patches:
    """One image's or video's patch rows `[t*h*w, row_size]` (float32, CPU) and its grid."""

    rows: Tensor
    grid: tuple[int, int, int]  # (t, h, w) in patches


def _check_aspect(height: int, width: int) -> None:
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise RequestInvalid(
            f"an image of {width}x{height} pixels has an aspect ratio over {MAX_ASPECT_RATIO}"
        )


def image_target_size(height: int, width: int, factor: int, min_pixels: int,
                      max_pixels: int) -> tuple[int, int]:
    """(height, width): multiples of `factor` within [min_pixels, max_pixels], ratio kept."""
    _check_aspect(height, width)
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def video_target_size(frames: int, height: int, width: int, factor: int, temporal: int,
                      min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """As `image_target_size`, with the pixel range counted over all (padded) frames; a frame
    smaller than `factor` is first scaled up for the computation."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    padded = round(frames / temporal) * temporal
    if padded * new_height * new_width > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif padded * new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    return new_height, new_width


def resize(frames: Tensor, height: int, width: int) -> Tensor:
    """Antialiased bicubic resize of uint8 `[n, 3, H, W]` frames on CPU (see the module docs)."""
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    return functional.interpolate(frames, size=[height, width], mode="bicubic",
                                  align_corners=False, antialias=True)


def normalise(frames: Tensor, settings: PixelSettings) -> Tensor:
    """uint8 -> float32 `(x - mean/scale) / (std/scale)`, the reference's fused form."""
    scale = 1.0 / settings.rescale_factor
    mean = torch.tensor([value * scale for value in settings.mean], dtype=torch.float32)
    std = torch.tensor([value * scale for value in settings.std], dtype=torch.float32)
    values = frames.to(torch.float32)
    return values.sub_(mean.view(1, 3, 1, 1)).div_(std.view(1, 3, 1, 1))


def patchify(frames: Tensor, settings: PixelSettings) -> Patches:
    """float32 `[n, 3, H, W]` -> rows `[t*h*w, 3*T*P*P]` in merge-window order."""
    temporal, patch, merge = (settings.temporal_patch_size, settings.patch_size,
                              settings.merge_size)
    if pad := -frames.shape[0] % temporal:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    count, channels, height, width = frames.shape
    grid_t, grid_h, grid_w = count // temporal, height // patch, width // patch
    blocks = frames.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch,
                            grid_w // merge, merge, patch)
    # -> t, h/m, w/m, m(h), m(w), channel, temporal, patch(h), patch(w)
    rows = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(
        grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return Patches(rows=rows.contiguous(), grid=(grid_t, grid_h, grid_w))


def _stack(arrays: tuple[np.ndarray, ...]) -> Tensor:
    """HWC uint8 arrays of one size -> `[n, 3, H, W]` uint8 tensor."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def image_patches(image: np.ndarray, settings: PixelSettings) -> Patches:
    """One decoded image `[H, W, 3]` uint8 -> its patch rows and grid (t = 1)."""
    height, width = image.shape[:2]
    target = image_target_size(height, width, settings.factor, settings.image_min_pixels,
                               settings.image_max_pixels)
    frames = resize(_stack((image,)), *target)
    return patchify(normalise(frames, settings), settings)


def video_patches(frames: tuple[np.ndarray, ...], settings: PixelSettings) -> Patches:
    """One video's decoded frames (one size) -> its patch rows and grid."""
    height, width = frames[0].shape[:2]
    target = video_target_size(len(frames), height, width, settings.factor,
                               settings.temporal_patch_size, settings.video_min_pixels,
                               settings.video_max_pixels)
    resized = resize(_stack(frames), *target)
    return patchify(normalise(resized, settings), settings)

"""Media in the model: the vision tower, the media tokens, multimodal rotary positions.

Loaded with the backbone only when the snapshot has a vision tower (`model.visual.*` tensors and
a `vision_config`) and a processor (`processor_config.json`) and `--media` is not off. The tower
is transformers' `Qwen3_5VisionModel`, built on meta from `vision_config` and given the release
tensors, like the text stack (clef_worker.model.backbone).

The layout follows the release (docs/model.md, "Media"):

- tokens, placed right after the prompt prefix: per image `<|vision_start|>`, t*h*w/4
  `<|image_pad|>`, `<|vision_end|>`; per video `<|vision_start|>`, then per pair of frames
  `<{s:.1f} seconds>` (the pair's mean frame index / 24) and `<|vision_start|>` h*w/4
  `<|video_pad|>` `<|vision_end|>`, then `<|vision_end|>`; images first, then videos, then `\n`;
- the pad tokens' input embeddings are replaced by the tower's merged outputs, in order;
- rotary positions have three rows (t, h, w): text advances all three by one per token; a block
  of pads (one image, or one frame pair of a video) at text position p gets rows
  (p + t, p + y, p + x) over its merged grid, and the text after it continues at
  p + max(h, w) / merge.

The prefix cache (clef_worker.serving.prefix.cache) keys a media request's states by
`PreparedMedia.digest`
(the media token ids are the same for any two pictures of one size, so the ids alone would let
two pictures share states) and reuses them only past the media's tokens, so a request that
reuses a prefix never runs the tower; `VisionTower.inputs` gives the prefixed forward the
embeddings and rotary rows of a request that does not.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from clef_protocol.media import DecodedMedia
from clef_worker.errors import StartupError
from clef_worker.media.pixels import (
    PROCESSOR_CONFIG,
    Patches,
    PixelSettings,
    image_patches,
    video_patches,
)
from clef_worker.model.backbone import Backbone, build_on_meta, read_tensors
from clef_worker.model.encoding import Encoder
from clef_worker.model.snapshot import Snapshot

log = logging.getLogger(__name__)

VISUAL_PREFIX = "model.visual."
FRAMES_PER_SECOND = 24  # frame lists carry no fps; the reference assumes 24


@dataclass(frozen=True)
class PreparedMedia:
    """One request's media, ready for the model: token ids to insert, patch rows, blocks."""

    token_ids: tuple[int, ...]
    image_rows: Tensor | None  # [rows, row_size] float32 on CPU
    video_rows: Tensor | None
    image_grids: tuple[tuple[int, int, int], ...]
    video_grids: tuple[tuple[int, int, int], ...]
    # The decoded pixels' digest (`media_digest`): what the prefix cache keys the request's
    # states by, beside its token ids.
    digest: str = ""

    @property
    def blocks(self) -> list[tuple[int, int, int]]:
        """The (t, h, w) patch grid of every run of pad tokens, in sequence order: each image,
        then each frame pair of each video."""
        pairs = [(1, h, w) for t, h, w in self.video_grids for _ in range(t)]
        return list(self.image_grids) + pairs


def has_vision(snapshot: Snapshot) -> str | None:
    """None when the snapshot can score media, else what it lacks."""
    if "vision_config" not in snapshot.config:
        return "config.json has no vision_config"
    if not any(name.startswith(VISUAL_PREFIX) for name in snapshot.weights):
        return f"the weights have no {VISUAL_PREFIX}* tensors"
    if not (snapshot.root / PROCESSOR_CONFIG).is_file():
        return f"there is no {PROCESSOR_CONFIG}"
    return None


class VisionTower:
    """The loaded tower plus everything needed to turn decoded media into model inputs."""

    def __init__(self, model: Any, settings: PixelSettings, encoder: Encoder,
                 config: dict[str, Any], device: torch.device, dtype: torch.dtype):
        self.model = model
        self.settings = settings
        self.encoder = encoder
        self.device = device
        self.dtype = dtype
        self.image_token = int(config["image_token_id"])
        self.video_token = int(config["video_token_id"])
        self.start_token = int(config["vision_start_token_id"])
        self.end_token = int(config["vision_end_token_id"])
        self.newline = tuple(encoder.tokenizer.encode("\n", add_special_tokens=False).ids)
        self.merge = settings.merge_size

    # -- request side ---------------------------------------------------------------------

    def prepare(self, media: DecodedMedia, digest: bool = True) -> PreparedMedia:
        """Pixels -> patch rows (CPU) and the token ids that go after the prefix; with `digest`
        (a worker whose prefix cache is on), the pixels' digest that keys the cached states
        (without one the request is never cached, and the hashing is not paid)."""
        images = [image_patches(image, self.settings) for image in media.images]
        videos = [video_patches(frames, self.settings) for frames in media.videos]
        ids: list[int] = []
        for patches in images:
            ids += [self.start_token, *([self.image_token] * self._tokens(patches.grid)),
                    self.end_token]
        for frames, patches in zip(media.videos, videos, strict=True):
            ids.append(self.start_token)
            per_pair = self._tokens((1, *patches.grid[1:]))
            for seconds in self._timestamps(len(frames)):
                ids += self.encoder.tokenizer.encode(f"<{seconds:.1f} seconds>",
                                                     add_special_tokens=False).ids
                ids += [self.start_token, *([self.video_token] * per_pair), self.end_token]
            ids.append(self.end_token)
        ids += self.newline
        return PreparedMedia(
            token_ids=tuple(ids),
            image_rows=_concat(images),
            video_rows=_concat(videos),
            image_grids=tuple(p.grid for p in images),
            video_grids=tuple(p.grid for p in videos),
            digest=media_digest(media) if digest else "",
        )

    def _tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def _timestamps(self, frames: int) -> list[float]:
        """Seconds of each frame pair: the mean of its two frame indices / 24 (an odd last frame
        is paired with itself, as its pixels are)."""
        temporal = self.settings.temporal_patch_size
        indices = list(range(frames))
        indices += [indices[-1]] * (-frames % temporal)
        return [(indices[i] + indices[i + temporal - 1]) / 2 / FRAMES_PER_SECOND
                for i in range(0, len(indices), temporal)]

    # -- model side -----------------------------------------------------------------------

    def embeddings(self, rows: Tensor, grids: tuple[tuple[int, int, int], ...]) -> Tensor:
        """The tower's merged outputs [tokens, H] for these rows."""
        grid = torch.tensor(grids, dtype=torch.long, device=self.device)
        output = self.model(rows.to(self.device, self.dtype), grid_thw=grid)
        return output.pooler_output

    def hidden_states(self, backbone: Backbone, ids: Tensor, media: PreparedMedia) -> Tensor:
        """Last hidden state [T, H] of a sequence holding `media`'s tokens."""
        embeds, positions = self.inputs(backbone, ids, media)
        output = backbone.model(inputs_embeds=embeds.unsqueeze(0),
                                position_ids=positions.unsqueeze(1), use_cache=False)
        return output.last_hidden_state[0]

    def inputs(self, backbone: Backbone, ids: Tensor, media: PreparedMedia
               ) -> tuple[Tensor, Tensor]:
        """The text stack's inputs for a sequence holding `media`'s tokens: the input
        embeddings [T, H] with the pads' replaced by the tower's outputs, and the rotary
        position rows [3, T] on the device."""
        embeds = backbone.model.embed_tokens(ids)
        for token, rows, grids in ((self.image_token, media.image_rows, media.image_grids),
                                   (self.video_token, media.video_rows, media.video_grids)):
            if rows is None:
                continue
            features = self.embeddings(rows, grids).to(embeds.dtype)
            mask = ids == token
            if int(mask.sum()) != features.shape[0]:
                raise RuntimeError(f"{int(mask.sum())} media tokens for {features.shape[0]} "
                                   "vision features")
            embeds = embeds.masked_scatter(mask.unsqueeze(-1), features)
        positions = rope_positions(ids.tolist(), media.blocks, (self.image_token,
                                   self.video_token), self.merge).to(self.device)
        return embeds, positions


def media_digest(media: DecodedMedia) -> str:
    """A digest of every decoded image and frame (kind, shape and pixels, in request order):
    two pictures never share it, so their states never share a prefix-cache chain; the same
    picture sent again (even re-encoded) has the same one. The pixels, not the encoded bytes,
    because they are what the tower's input is made from. It costs about 5 ms per megapixel
    (measured on one CPU core), on the serve loop's helper thread, beside the decoding."""
    digest = hashlib.blake2b(digest_size=16)

    def add(kind: bytes, pixels: np.ndarray) -> None:
        digest.update(kind + repr(pixels.shape).encode())
        digest.update(np.ascontiguousarray(pixels).data)

    for image in media.images:
        add(b"image", image)
    for number, frames in enumerate(media.videos):
        for frame in frames:
            add(f"video{number}".encode(), frame)
    return digest.hexdigest()


def _concat(patches: list[Patches]) -> Tensor | None:
    return torch.cat([p.rows for p in patches]) if patches else None


def rope_positions(ids: list[int], blocks: list[tuple[int, int, int]],
                   pad_tokens: tuple[int, ...], merge: int) -> Tensor:
    """The (t, h, w) rotary position rows [3, T] of a sequence (see the module docs)."""
    rows: list[Tensor] = []
    grids = iter(blocks)
    position = 0
    index = 0
    length = len(ids)
    while index < length:
        if ids[index] in pad_tokens:
            t, h, w = next(grids)
            h, w = h // merge, w // merge
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                              indexing="ij")).reshape(3, -1)
            rows.append(grid + position)
            index += t * h * w
            position += max(h, w)
            continue
        end = index
        while end < length and ids[end] not in pad_tokens:
            end += 1
        rows.append(torch.arange(position, position + end - index).expand(3, -1))
        position += end - index
        index = end
    return torch.cat(rows, dim=1)


def load_vision(snapshot: Snapshot, encoder: Encoder, device: torch.device,
                dtype: torch.dtype) -> VisionTower:
    """Build the tower on meta, load `model.visual.*` (strict), read the processor settings."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    settings = PixelSettings.from_file(snapshot.root / PROCESSOR_CONFIG)
    model = build_on_meta(snapshot, Qwen3_5VisionModel, "vision_config", "the vision tower")
    expected = set(model.state_dict())
    files = {name[len(VISUAL_PREFIX):]: path for name, path in snapshot.weights.items()
             if name.startswith(VISUAL_PREFIX)}
    missing = sorted(expected - set(files))
    if missing:
        raise StartupError(f"snapshot {snapshot.root}: the vision tower lacks tensor "
                           f"{VISUAL_PREFIX}{missing[0]}")
    state = read_tensors({name: files[name] for name in expected}, device, dtype,
                          prefix=VISUAL_PREFIX)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except Exception as exc:
        raise StartupError(f"snapshot {snapshot.root}: cannot load the vision tower: {exc}") \
            from exc
    # The rotary frequencies are non-persistent buffers that meta construction left empty.
    model.rotary_pos_emb = type(model.rotary_pos_emb)(model.config).to(device)
    model.eval()
    model.requires_grad_(False)
    log.info("vision tower loaded (%d tensors); images become %d to %d pixels", len(state),
             settings.image_min_pixels, settings.image_max_pixels)
    return VisionTower(model, settings, encoder, snapshot.config, device, dtype)

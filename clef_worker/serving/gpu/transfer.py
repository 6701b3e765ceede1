"""One host-to-device copy per request for every integer tensor the forward and head need.

Why: on a GPU, each small `.to(device)` is a separate copy with its own launch and host
overhead; the padded ids and the head's eight index tensors would be nine. They are all int64, so
they travel as one flat (pinned) host buffer and are split back into views on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def stage_host(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """The host half of a packed copy: one flat int64 buffer, pinned when it is bound for
    CUDA (pinning is host work: the serve loop's helper thread does it while the device runs
    the previous group)."""
    flat = pack(tensors)
    return flat.pin_memory() if device.type == "cuda" else flat


def move_staged(flat: Tensor, shapes: Sequence[torch.Size], device: torch.device) -> list[Tensor]:
    """The device half: one copy of a staged buffer (without blocking), cut into views."""
    if device.type != "cpu":
        flat = flat.to(device, non_blocking=True)
    return unpack(flat, shapes)


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """One flat int64 tensor holding every tensor's elements, in order."""
    if any(t.dtype != torch.long for t in tensors):
        raise TypeError("only int64 tensors can be packed")
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: Tensor, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Views of `flat` with the given shapes, consecutive from the start."""
    views: list[Tensor] = []
    offset = 0
    for shape in shapes:
        count = shape.numel()
        views.append(flat[offset:offset + count].view(shape))
        offset += count
    if offset != flat.numel():
        raise ValueError(f"shapes cover {offset} elements, the buffer holds {flat.numel()}")
    return views

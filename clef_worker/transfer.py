"""One host-to-device copy per request for every integer tensor the forward and head need.

Why: on a GPU, each small `.to(device)` is a separate copy with its own launch and host
overhead; the padded ids and the head's eight index tensors would be nine. They are all int64, so
they travel as one flat (pinned) host buffer and are split back into views on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device_packed(tensors: Sequence[Tensor], device: torch.device) -> list[Tensor]:
    """Move int64 tensors to `device` in one copy; returns views with the original shapes."""
    if device.type == "cpu" or not tensors:
        return list(tensors)
    if any(t.dtype != torch.long for t in tensors):
        raise TypeError("to_device_packed moves int64 tensors only")
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=True)
    views: list[Tensor] = []
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        views.append(moved[offset:offset + count].view(tensor.shape))
        offset += count
    return views

"""Random clef-finetune checkpoints for any backbone shape, written in clef-finetune's layout.

Benchmarks only: the variant tests use checkpoints the real tool made (tests/fixtures/finetune).
A benchmark at Clef-Flash's shapes has no real fine-tune, and running clef-finetune there would
spend the device's time on training, so this writes what a server reads from a checkpoint
(`adapter/adapter_config.json`, `adapter/adapter_model.safetensors`, `joint_head.safetensors`,
`train_config.json`) with random values, every linear layer of the text stack adapted, as
clef-finetune's default targets do. The shapes come from the loaded model itself (pass its text
stack and head before any variant is attached).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from clef_worker.variants import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    HEAD_WEIGHTS,
    KEY_PREFIX,
)


def write_checkpoint(directory: Path, text_model: nn.Module, head: nn.Module, *, rank: int,
                     alpha: float, seed: int, dtype: torch.dtype = torch.float32) -> Path:
    """One random checkpoint for the stack and head given (shapes only are read)."""
    generator = torch.Generator().manual_seed(seed)
    adapter: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for name, module in text_model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        targets.add(name.rsplit(".", 1)[-1])
        a = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
        b = torch.randn(module.out_features, rank, generator=generator) * 0.01
        adapter[f"{KEY_PREFIX}{name}.lora_A.weight"] = a.to(dtype)
        adapter[f"{KEY_PREFIX}{name}.lora_B.weight"] = b.to(dtype)
    head_state = {name: (torch.randn(tuple(t.shape), generator=generator) * 0.02).to(dtype)
                  for name, t in head.state_dict().items()}
    (directory / ADAPTER_DIR).mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                              "use_dora": False, "use_rslora": False, "bias": "none",
                              "modules_to_save": None,
                              # Every adapted module by its last name, as PEFT matches a list
                              # (the worker refuses a tensor target_modules does not name).
                              "target_modules": sorted(targets)}
    (directory / ADAPTER_DIR / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(adapter, str(directory / ADAPTER_DIR / ADAPTER_WEIGHTS))
    save_file(head_state, str(directory / HEAD_WEIGHTS))
    (directory / "train_config.json").write_text(json.dumps({"synthetic": True, "seed": seed}))
    return directory


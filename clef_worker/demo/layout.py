"""Names, shapes and init kinds of every tensor a demo snapshot holds, read from the modules
that load them: transformers' Qwen3.5 model for the backbone, `JointSchemaHead` for the head.

One subtlety: importing transformers' Qwen3.5 modelling module binds the Gated DeltaNet kernel
(fla or torch) for the life of the process, and the native executor wants to make that choice
itself (`--gdn-prefill`). So the backbone's layout is read in-process only when that import
cannot change anything (the module is already imported, or fla and causal_conv1d are absent or
blocked); otherwise a short-lived child process reads it with them blocked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from clef_worker.model.head import HeadConfig
from clef_worker.model.kernel_choice import KERNEL_PACKAGES
from clef_worker.model.module_names import MODELING_MODULE

# A tensor to generate: name -> (shape, kind). `kind` picks the initialisation (see _draw).
Layout = dict[str, tuple[tuple[int, ...], str]]

def backbone_layout(config_text: str) -> Layout:
    """Names, shapes and init kinds of the backbone tensors, as transformers lays them out."""
    if _modelling_import_is_harmless():
        return _layout_from_config_text(config_text)
    return _layout_in_child(config_text)


def _modelling_import_is_harmless() -> bool:
    """True when importing the Qwen3.5 modelling module now binds what any guard would bind.

    That is: it is already imported, or each optional kernel package it binds at import (fla, and
    causal_conv1d, which the native executor blocks on CPU) is either blocked or not installed.
    """
    if MODELING_MODULE in sys.modules:
        return True
    return all(_blocked_or_absent(package) for package in KERNEL_PACKAGES)


def _blocked_or_absent(package: str) -> bool:
    if package in sys.modules:
        return sys.modules[package] is None
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):
        return False


def _layout_in_child(config_text: str) -> Layout:
    with tempfile.TemporaryDirectory(prefix="clef-demo-layout-") as work:
        config_path = Path(work) / "config.json"
        out_path = Path(work) / "layout.json"
        config_path.write_text(config_text, encoding="utf-8")
        code = (
            'import sys\n'
            f"for name in {KERNEL_PACKAGES!r}: sys.modules[name] = None\n"
            "import pathlib, json\n"
            "from clef_worker.demo.layout import _layout_from_config_text\n"
            "text = pathlib.Path(sys.argv[1]).read_text(encoding='utf-8')\n"
            "layout = _layout_from_config_text(text)\n"
            "pathlib.Path(sys.argv[2]).write_text(json.dumps(layout), encoding='utf-8')\n"
        )
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, "-c", code, str(config_path), str(out_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=env, check=False,
        )
        if result.returncode != 0:
            tail = result.stderr.decode("utf-8", "replace")[-2000:]
            raise RuntimeError(f"reading the Qwen3.5 tensor layout failed:\n{tail}")
        raw = json.loads(out_path.read_text(encoding="utf-8"))
    return {name: (tuple(shape), kind) for name, (shape, kind) in raw.items()}


def _layout_from_config_text(config_text: str) -> Layout:
    """Build Qwen3_5ForConditionalGeneration on the meta device and list its tensors."""
    import torch
    from torch import nn
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    config = Qwen3_5Config.from_dict(json.loads(config_text))
    with torch.device("meta"):
        model = qwen.Qwen3_5ForConditionalGeneration(config)
    layout: Layout = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, qwen.Qwen3_5RMSNorm):
                kind = "centred_norm"  # applied as (1 + weight)
            elif isinstance(module, qwen.Qwen3_5RMSNormGated | nn.LayerNorm):
                kind = "norm_" + param_name
            elif isinstance(module, qwen.Qwen3_5GatedDeltaNet) and param_name in ("A_log",
                                                                                  "dt_bias"):
                kind = param_name
            elif isinstance(module, nn.Embedding) or name == "lm_head.weight":
                kind = "pos_embedding" if "visual" in name else "token_table"
            else:
                kind = "weight" if param.dim() >= 2 else "bias"
            layout[name] = (tuple(param.shape), kind)
    expected = set(model.state_dict())
    if set(layout) != expected:
        raise RuntimeError(f"tensor layout mismatch: {sorted(set(layout) ^ expected)[:5]}")
    return layout




def head_layout(config: HeadConfig) -> Layout:
    """The joint head's tensors, read from `JointSchemaHead` itself built on the meta device
    (as `clef_worker.model.snapshot` does to check a release head), so the demo can never drift from
    the module that loads it."""
    import torch
    from torch import nn

    from clef_worker.model.head import JointSchemaHead

    with torch.device("meta"):
        head = JointSchemaHead(config)
    layout: Layout = {}
    for module_name, module in head.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.LayerNorm):
                kind = "norm_" + param_name
            elif name == "type_embedding.weight":
                kind = "type_embedding"
            elif param.dim() == 0:
                kind = "scalar_" + param_name
            else:
                kind = "weight" if param.dim() >= 2 else "bias"
            layout[name] = (tuple(param.shape), kind)
    return layout

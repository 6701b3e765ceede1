"""Snapshot checks: a wrong or incomplete snapshot fails start-up with a message naming the file,
the tensor or the variant; a sharded snapshot loads like a single-file one."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import StartupError
from clef_worker.model.snapshot import RANDOM_MARKER, open_snapshot

INVOICE = {
    "model": "clef-flash",
    "state": "Invoice #4411 from Acme for $12,400 was due on 2026-09-30 and is still unpaid.",
    "questions": {
        "status": {"type": "choice", "instructions": "What is the payment status?",
                   "criteria": {"paid": "Settled in full", "overdue": "Past due"}},
        "large": {"type": "noul", "instructions": "Is the amount above $10,000?"},
    },
}


@pytest.fixture
def snapshot(tiny_snapshot: Path, tmp_path: Path) -> Path:
    """A writable copy of the tiny fixture (the shared one is read-only)."""
    copy = tmp_path / "clef-tiny"
    shutil.copytree(tiny_snapshot, copy)
    for path in [copy, *copy.iterdir()]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return copy


def _rewrite(path: Path, change: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(path)
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


def test_fixture_opens_as_random(snapshot: Path) -> None:
    opened = open_snapshot(snapshot, variant="clef-flash")
    assert opened.random
    assert opened.hidden_size == 64
    assert "lm_head.weight" in opened.weights
    assert not any(name.startswith("visual") for name in opened.text_tensors())


@pytest.mark.parametrize(
    "name",
    ["config.json", "tokenizer.json", "joint_head_config.json", "joint_head.safetensors",
     "model.safetensors"],
)
def test_missing_file_is_named(snapshot: Path, name: str) -> None:
    (snapshot / name).unlink()
    with pytest.raises(StartupError, match=name.replace(".", r"\.")):
        open_snapshot(snapshot, variant="clef-flash")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="does not exist"):
        open_snapshot(tmp_path / "nowhere", variant="clef-flash")


def test_wrong_head_shape_names_file_and_tensor(snapshot: Path) -> None:
    _rewrite(snapshot / "joint_head.safetensors",
             {"layers.0.linear1.weight": torch.zeros(48, 32, dtype=torch.bfloat16)})
    with pytest.raises(StartupError) as failed:
        open_snapshot(snapshot, variant="clef-flash")
    message = str(failed.value)
    assert "joint_head.safetensors" in message
    assert "layers.0.linear1.weight" in message
    assert "[48, 32]" in message and "[64, 32]" in message


def test_missing_and_unexpected_head_tensors(snapshot: Path) -> None:
    head = snapshot / "joint_head.safetensors"
    _rewrite(head, {"residual_gate": None})
    with pytest.raises(StartupError, match="missing tensor residual_gate"):
        open_snapshot(snapshot, variant="clef-flash")
    _rewrite(head, {"residual_gate": torch.zeros((), dtype=torch.bfloat16),
                    "extra.weight": torch.zeros(2)})
    with pytest.raises(StartupError, match=r"unexpected tensor extra\.weight"):
        open_snapshot(snapshot, variant="clef-flash")


def test_head_config_disagreeing_with_backbone(snapshot: Path) -> None:
    config = json.loads((snapshot / "joint_head_config.json").read_text())
    config["hidden_size"] = 128
    (snapshot / "joint_head_config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match=r"hidden_size 128 does not match .* 64"):
        open_snapshot(snapshot, variant="clef-flash")


def test_bad_head_config_value(snapshot: Path) -> None:
    config = json.loads((snapshot / "joint_head_config.json").read_text())
    config["heads"] = 5
    (snapshot / "joint_head_config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match=r"joint_head_config\.json: width 32 is not divisible"):
        open_snapshot(snapshot, variant="clef-flash")


def test_wrong_model_type(snapshot: Path) -> None:
    config = json.loads((snapshot / "config.json").read_text())
    config["model_type"] = "llama"
    (snapshot / "config.json").write_text(json.dumps(config))
    with pytest.raises(StartupError, match=r"config\.json: model_type must be 'qwen3_5'"):
        open_snapshot(snapshot, variant="clef-flash")


@pytest.mark.parametrize(("variant", "expected"), [("clef-flash", 4096), ("clef", 5120)])
def test_wrong_variant_fails(snapshot: Path, variant: str, expected: int) -> None:
    """Without the random-model marker the snapshot is held to the release's hidden size."""
    (snapshot / RANDOM_MARKER).unlink()
    with pytest.raises(StartupError) as failed:
        open_snapshot(snapshot, variant=variant)
    message = str(failed.value)
    assert f"--variant {variant} expects hidden size {expected}" in message
    assert "hidden size 64" in message


def test_demo_flag_skips_the_release_size_check(snapshot: Path) -> None:
    (snapshot / RANDOM_MARKER).unlink()
    assert open_snapshot(snapshot, variant="clef-flash", demo=True).random


def test_unknown_variant(snapshot: Path) -> None:
    with pytest.raises(StartupError, match="unknown --variant"):
        open_snapshot(snapshot, variant="clef-huge")


def test_missing_lexical_table(snapshot: Path) -> None:
    _rewrite(snapshot / "model.safetensors", {"lm_head.weight": None})
    with pytest.raises(StartupError, match=r"lm_head\.weight"):
        open_snapshot(snapshot, variant="clef-flash")


def test_wrong_backbone_tensor_shape(snapshot: Path) -> None:
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    _rewrite(snapshot / "model.safetensors", {name: torch.zeros(96, 64, dtype=torch.bfloat16)})
    with pytest.raises(StartupError) as failed:
        assemble_snapshot(snapshot, device="cpu")
    assert name in str(failed.value) and "model.safetensors" in str(failed.value)


def test_missing_backbone_tensor(snapshot: Path) -> None:
    name = "model.language_model.norm.weight"
    _rewrite(snapshot / "model.safetensors", {name: None})
    with pytest.raises(StartupError, match=name.replace(".", r"\.")):
        assemble_snapshot(snapshot, device="cpu")


def _shard(snapshot: Path) -> list[str]:
    """Split model.safetensors into two shards plus an index, like the release."""
    tensors = load_file(snapshot / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for file_name, half in zip(files, halves, strict=True):
        save_file({name: tensors[name] for name in half}, snapshot / file_name,
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    return files


def test_sharded_snapshot_scores_like_single_file(snapshot: Path, tiny_snapshot: Path) -> None:
    single = assemble_snapshot(tiny_snapshot, device="cpu").score(INVOICE)
    _shard(snapshot)
    sharded = assemble_snapshot(snapshot, device="cpu").score(INVOICE)
    assert sharded.encoding.input_ids == single.encoding.input_ids
    assert sharded.logits == single.logits


def test_missing_shard_is_named(snapshot: Path) -> None:
    files = _shard(snapshot)
    (snapshot / files[1]).unlink()
    with pytest.raises(StartupError, match=files[1].replace(".", r"\.")):
        open_snapshot(snapshot, variant="clef-flash")

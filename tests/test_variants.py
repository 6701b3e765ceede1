"""Fine-tuned variants (clef-finetune checkpoints, `--finetune`) in the native executor: each
variant's answers equal the upstream reference on its float32-merged release, the base's golden
answers are unchanged on the same executor, mixed groups equal each request alone (segments and
the stacked path), and bad checkpoints are refused at start-up naming the file and the tensor.

The checkpoints and the reference answers are tests/fixtures/finetune (made by clef-finetune
itself: make_variants.py there)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchlib.executors import with_limits
from benchlib.golden import Drift, answered, assert_response_matches
from benchlib.paths import FINETUNE_FIXTURES, FINETUNE_REFERENCE, TINY_SNAPSHOT
from clef_protocol.finetune import Finetune, resolve_finetunes, scan_finetunes
from clef_protocol.options import RequestLimits, add_model_arguments, worker_argv
from clef_worker.adapter_config import read_lora_config
from clef_worker.assembly import assemble_snapshot
from clef_worker.errors import StartupError
from clef_worker.model.lora import (
    STACKED,
    AdaptedLinear,
    AdapterSelection,
    LoraWeights,
    merge_segments,
    token_slots,
)
from clef_worker.native import NativeExecutor
from clef_worker.serving.gpu.graphs import GraphRunner
from clef_worker.variants import KEY_PREFIX, linear_layers, load_variants, read_adapter
from tests.answer_compare import assert_same_response

# The golden bound for a variant: fp32 on CPU, unmerged against merged.
VARIANT_LOGIT_TOLERANCE = 1.5e-4
VARIANTS = ("tiny-alpha", "tiny-beta")
REFERENCE = [json.loads(line) for line in FINETUNE_REFERENCE.read_text().splitlines() if line]


def _finetunes() -> tuple[Finetune, ...]:
    return tuple(resolve_finetunes([str(FINETUNE_FIXTURES)]))


@pytest.fixture(scope="module")
def executor(tiny_snapshot: Path) -> NativeExecutor:
    """The worker's defaults on CPU (float32, packed batches) with both variants."""
    return assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                             limits=RequestLimits(), finetunes=_finetunes())


def _limited(executor: NativeExecutor, case: dict[str, Any]) -> NativeExecutor:
    return with_limits(executor, dataclasses.replace(executor.limits,
                                                    max_length=case["max_length"]))


def test_the_fixtures_were_made_from_the_served_snapshot() -> None:
    """The variants are only valid over the exact base they were trained on."""
    recorded = json.loads((FINETUNE_FIXTURES / "base.json").read_text())
    for name, digest in recorded.items():
        assert hashlib.sha256((TINY_SNAPSHOT / name).read_bytes()).hexdigest() == digest, name
    for variant in VARIANTS:
        assert not (FINETUNE_FIXTURES / variant / "training_state.pt").exists()
    assert {row["variant"] for row in REFERENCE} == set(VARIANTS)
    assert len(REFERENCE) == len(VARIANTS) * len(answered())


@pytest.mark.parametrize("row", REFERENCE, ids=[f"{r['variant']}-{r['name']}" for r in REFERENCE])
def test_variant_equals_the_reference_on_its_merged_release(executor: NativeExecutor,
                                                           row: dict[str, Any]) -> None:
    limited = _limited(executor, row)
    scored = limited.score(row["request"])
    drift = Drift()
    drift.add(row, scored.logits, scored.probabilities)
    assert drift.max_logit_diff <= VARIANT_LOGIT_TOLERANCE and not drift.argmax_mismatches, drift
    answer = limited.answer(json.dumps(row["request"]).encode())
    assert_response_matches(json.loads(answer.body), row["response"], scored.probabilities)


@pytest.mark.parametrize("case", answered(), ids=[c["name"] for c in answered()])
def test_base_goldens_unchanged_beside_variants(executor: NativeExecutor,
                                               case: dict[str, Any]) -> None:
    scored = _limited(executor, case).score(case["request"])
    drift = Drift()
    drift.add(case, scored.logits, scored.probabilities)
    assert drift.within_tolerance, drift


def test_the_lora_part_matters(executor: NativeExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its adapters (only its head), a variant is far from the reference: the parity
    above checks the LoRA arithmetic, not only the head."""
    row = REFERENCE[0]
    monkeypatch.setattr(executor.runner, "selection", None)
    scored = executor.score(row["request"])
    drift = Drift()
    drift.add(row, scored.logits, scored.probabilities)
    assert drift.max_logit_diff > 100 * VARIANT_LOGIT_TOLERANCE


def _mixed_bodies() -> list[bytes]:
    """Base, alpha and beta requests of several lengths, interleaved."""
    cases = [c for c in answered() if c["max_length"] == RequestLimits().max_length][:6]
    models = ["clef-flash", "tiny-alpha", "tiny-beta", "tiny-alpha", "clef-flash", "tiny-beta"]
    return [json.dumps(dict(case["request"], model=model)).encode()
            for case, model in zip(cases, models, strict=True)]


def _alone(executor: NativeExecutor, bodies: list[bytes]) -> list[bytes]:
    return [executor.answer(body).body for body in bodies]


def test_a_mixed_group_equals_each_request_alone(executor: NativeExecutor) -> None:
    bodies = _mixed_bodies()
    alone = _alone(executor, bodies)
    grouped = executor.answer_prepared([executor.prepare(body) for body in bodies])
    assert [answer.batch_size for answer in grouped] == [len(bodies)] * len(bodies)
    for got, want in zip(grouped, alone, strict=True):
        assert_same_response(got.body, want)
    # Each model's answer is its own: the variants answer unlike the base.
    assert len({json.dumps(json.loads(b)["answers"]) for b in alone[:3]}) == 3


def test_the_stacked_path_equals_segments(executor: NativeExecutor,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA design (stacked adapters, per-token index, fixed shapes) run on CPU."""
    bodies = _mixed_bodies()
    alone = _alone(executor, bodies)
    selection = executor.runner.selection
    assert selection is not None
    monkeypatch.setattr(selection, "mode", STACKED)
    grouped = executor.answer_prepared([executor.prepare(body) for body in bodies])
    for got, want in zip(grouped, alone, strict=True):
        assert_same_response(got.body, want)


def test_padded_mixed_groups_equal_each_request_alone(tiny_snapshot: Path) -> None:
    padded = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               batch_layout="padded", finetunes=_finetunes())
    bodies = _mixed_bodies()
    alone = _alone(padded, bodies)
    grouped = padded.answer_prepared([padded.prepare(body) for body in bodies])
    for got, want in zip(grouped, alone, strict=True):
        assert_same_response(got.body, want)


@pytest.fixture(scope="module")
def padded_buckets(tiny_snapshot: Path) -> NativeExecutor:
    """The padded layout's `[rows, bucket]` shapes with both variants, built at warm-up as
    `--cuda-graphs on` builds them on CPU: eagerly, through the code a CUDA capture records
    (the stacked path over each shape's static slot buffer)."""
    padded = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", cuda_graphs="on",
                               batch_layout="padded", max_batch_tokens=4096,
                               graph_max_length=512, finetunes=_finetunes())
    padded.warm_up()
    return padded


def _mixed_group(size: int) -> list[bytes]:
    """`size` requests of different lengths, the base and both variants in turn."""
    cases = [c for c in answered() if c["max_length"] == RequestLimits().max_length][:size]
    assert len(cases) == size
    models = ("clef-flash", *VARIANTS)
    return [json.dumps(dict(case["request"], model=models[i % 3])).encode()
            for i, case in enumerate(cases)]


@pytest.mark.parametrize("size", [3, 5, 6, 7])
def test_mixed_groups_on_padded_buckets_take_one_forward(
        executor: NativeExecutor, padded_buckets: NativeExecutor, size: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed group of 3, 5, 6 or 7 pads to a shape of 4 or 8 rows: its slot index covers the
    pad rows too, the whole group is one replay (no forward per request, no eager fallback),
    and every answer equals the request alone on the unpadded, graph-free executor."""
    graphs = padded_buckets.runner.graphs
    assert isinstance(graphs, GraphRunner) and graphs.selection is not None
    # A launch-bound device (what graphs are for): every replay costs the same, so the planner
    # batches; on CPU the measured costs may favour one replay per request.
    monkeypatch.setattr(graphs, "costs_ms", dict.fromkeys(graphs.static, 1.0))
    bodies = _mixed_group(size)
    prepared = [padded_buckets.prepare(body) for body in bodies]
    [step] = padded_buckets.runner.plan([len(p.encoding.input_ids) for p in prepared])
    assert step.shape is not None and step.shape[0] > size  # pad rows in the forward
    replays, fallbacks = sum(graphs.stats.replays.values()), graphs.stats.eager_fallbacks
    grouped = padded_buckets.answer_prepared(prepared)
    assert sum(graphs.stats.replays.values()) == replays + 1
    assert graphs.stats.replays[step.shape] >= 1
    assert graphs.stats.eager_fallbacks == fallbacks
    assert [answer.batch_size for answer in grouped] == [size] * size
    for got, want in zip(grouped, _alone(executor, bodies), strict=True):
        assert_same_response(got.body, want)
    # The same shape next holds the base alone: its slot buffer is rewritten to the base's.
    base_only = [json.dumps(dict(json.loads(body), model="clef-flash")).encode()
                 for body in bodies]
    for got, want in zip(padded_buckets.answer_prepared(
            [padded_buckets.prepare(body) for body in base_only]),
            _alone(executor, base_only), strict=True):
        assert_same_response(got.body, want)


def test_the_stacked_index_covers_every_token_of_the_forward() -> None:
    """A padded forward's tokens beyond the last request (its pad rows) are the base's, and an
    index of another size than the forward is refused, never sliced or broadcast."""
    selection = AdapterSelection(STACKED)
    with selection.using([1, 2], [(0, 3), (3, 6)], torch.device("cpu"), tokens=12):
        assert selection.token_slots is not None
        assert selection.token_slots.tolist() == [1] * 3 + [2] * 3 + [0] * 6
    adapted = AdaptedLinear(torch.nn.Linear(4, 4), selection)
    adapted.add(1, LoraWeights(torch.ones(2, 4), torch.ones(4, 2)))
    with selection.using([1], [(0, 3)], torch.device("cpu")), \
            pytest.raises(ValueError, match="3 token slots for a forward of 6 tokens"):
        adapted(torch.zeros(2, 3, 4))


def test_segments_and_token_slots() -> None:
    spans = [(0, 3), (3, 5), (5, 9), (9, 10)]
    assert merge_segments([1, 1, 0, 2], spans) == ((0, 5, 1), (9, 10, 2))
    assert merge_segments([0, 0, 0, 0], spans) == ()
    assert token_slots(((0, 5, 1), (9, 10, 2)), 11).tolist() == [1] * 5 + [0] * 4 + [2, 0]


def test_describe_lists_each_variant(executor: NativeExecutor) -> None:
    described = {item["name"]: item for item in executor.describe().finetunes}
    assert list(described) == list(VARIANTS)
    assert (described["tiny-alpha"]["rank"], described["tiny-alpha"]["scale"]) == (4, 2.0)
    assert (described["tiny-beta"]["rank"], described["tiny-beta"]["scale"]) == (2, 0.5)
    assert described["tiny-beta"]["head"].endswith("tiny-beta/joint_head.safetensors")
    assert described["tiny-alpha"]["base_model_name_or_path"] == "tests/fixtures/clef-tiny"


def test_rslora_and_a_foreign_base_are_served_as_peft_runs_them(
        executor: NativeExecutor, tiny_snapshot: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """tiny-alpha's factors with rsLoRA at alpha 4 (scale 4 / sqrt(4) = 2, tiny-alpha's own
    scale): every answer equals tiny-alpha's. Its config names another base: served, shown in
    /health, and a WARNING says so; the fixtures' own base raises none."""
    finetune = _broken(tmp_path, lambda c: _config(c, use_rslora=True, lora_alpha=4,
                                                   base_model_name_or_path="Qwen/Qwen3.5-9B"))
    caplog.set_level(logging.WARNING, logger="clef_worker.variants")
    rs = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                           finetunes=(*_finetunes(), finetune))
    [described] = [item for item in rs.describe().finetunes if item["name"] == "broken"]
    assert (described["scale"], described["base_model_name_or_path"]) == (2.0, "Qwen/Qwen3.5-9B")
    [warning] = [r.getMessage() for r in caplog.records if r.name == "clef_worker.variants"]
    assert warning.startswith("variant broken: its adapter was trained over "
                              "base_model_name_or_path 'Qwen/Qwen3.5-9B', and this worker "
                              "serves clef-flash")
    bodies = _mixed_group(3)
    for body in bodies:
        mine = json.dumps(dict(json.loads(body), model="broken")).encode()
        alpha = json.dumps(dict(json.loads(body), model="tiny-alpha")).encode()
        got = json.loads(rs.answer(mine).body)
        assert got["model"] == "broken"
        got["model"] = "tiny-alpha"
        assert_same_response(json.dumps(got).encode(), executor.answer(alpha).body)


def test_a_base_named_by_the_served_model_name_is_not_foreign(
        tiny_snapshot: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint trained over the hub's `Qwen/Qwen3.5-9B`, served by a worker whose base is
    served as `qwen3.5-9b` (`--served-model-name`, which the front passes on): the names agree,
    no WARNING; without that name the same checkpoint gets one."""
    from clef_worker.loading import load_executor
    from clef_worker.main import parse_args

    finetune = _broken(tmp_path, lambda c: _config(c, base_model_name_or_path="Qwen/Qwen3.5-9B"))
    caplog.set_level(logging.WARNING, logger="clef_worker.variants")
    for served, warned in (("qwen3.5-9b", False), ("clef-flash-prod", True)):
        caplog.clear()
        args = parse_args(["--model", str(tiny_snapshot), "--device", "cpu",
                           "--finetune", f"broken={finetune.checkpoint}",
                           "--served-model-name", served])
        load_executor(args, tiny_snapshot, demo=False)
        warnings = [r.getMessage() for r in caplog.records if r.name == "clef_worker.variants"]
        assert bool(warnings) is warned, (served, warnings)


@pytest.mark.parametrize("change", [
    {"target_modules": "all-linear"},
    {"target_modules": ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                        "gate_proj", "up_proj", "down_proj", "q_proj", "k_proj", "v_proj",
                        "o_proj"]},
    {"target_modules": r"model\.language_model\.layers\.\d+\.(linear_attn|self_attn|mlp)\..*"},
    {"init_lora_weights": "gaussian", "fan_in_fan_out": True, "lora_dropout": 0.05},
], ids=["all-linear", "a list of names", "a pattern", "init, fan_in_fan_out, dropout"])
def test_configs_peft_runs_as_plain_lora_read_every_tensor(
        executor: NativeExecutor, tmp_path: Path, change: dict[str, Any]) -> None:
    checkpoint = _broken(tmp_path, lambda c: _config(c, **change)).checkpoint / "adapter"
    config = read_lora_config(checkpoint / "adapter_config.json")
    tensors = read_adapter(checkpoint / "adapter_model.safetensors", config,
                           linear_layers(executor.backbone.model))
    assert len(tensors) == 31 and config.scale == 2.0


def test_a_targeted_module_without_tensors_is_the_base_with_zero_init(
        executor: NativeExecutor, tmp_path: Path) -> None:
    """With `init_lora_weights` true (B starts at zero), PEFT leaves a targeted module the file
    has no tensors for as the base: so does this server (the same file with `false` is refused:
    REFUSALS)."""
    checkpoint = _broken(tmp_path, _drop_up_proj).checkpoint / "adapter"
    config = read_lora_config(checkpoint / "adapter_config.json")
    tensors = read_adapter(checkpoint / "adapter_model.safetensors", config,
                           linear_layers(executor.backbone.model))
    assert "layers.0.mlp.up_proj" not in tensors and len(tensors) == 30


# -- the flag ---------------------------------------------------------------------------------


def test_finetune_values_resolve(tmp_path: Path) -> None:
    named = resolve_finetunes([f"mine={FINETUNE_FIXTURES / 'tiny-alpha'}"])
    assert named == [Finetune("mine", (FINETUNE_FIXTURES / "tiny-alpha").resolve())]
    with pytest.raises(ValueError, match="already a served model name"):
        resolve_finetunes([f"clef-flash={FINETUNE_FIXTURES / 'tiny-alpha'}"], ("clef-flash",))
    with pytest.raises(ValueError, match="given twice"):
        resolve_finetunes([str(FINETUNE_FIXTURES), f"tiny-beta={FINETUNE_FIXTURES}"])
    assert resolve_finetunes([str(tmp_path)]) == []  # an empty directory: the base alone
    with pytest.raises(ValueError, match="not a directory"):
        resolve_finetunes([f"x={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="no such directory of checkpoints"):
        resolve_finetunes([str(tmp_path / "missing")])


def test_a_directorys_entries_are_refused_one_by_one(tmp_path: Path) -> None:
    """In a directory, a checkpoint named like the base (its served name, an alias, the model
    id), one whose name is taken or unusable, is refused on its own, saying which; the rest is
    served (what the worker does on every start and roll, clef_worker.loading.finetunes_of)."""
    directory = tmp_path / "runs"
    for name in ("tiny-alpha", "clef-flash", "flash", "bad name", "tiny-beta"):
        shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", directory / name)
    found, refused = scan_finetunes(
        [f"tiny-beta={FINETUNE_FIXTURES / 'tiny-beta'}", str(directory)],
        ("flash", "clef-flash"))
    assert [f.name for f in found] == ["tiny-beta", "tiny-alpha"]
    assert [str(r) for r in refused] == [
        f"--finetune {directory}: bad name: 'bad name' is not a usable model name; give it "
        "one with NAME=CHECKPOINT",
        f"--finetune {directory}: clef-flash: 'clef-flash' is already a served model name (the "
        "base's): refused, the base keeps its name",
        f"--finetune {directory}: flash: 'flash' is already a served model name (the base's): "
        "refused, the base keeps its name",
        f"--finetune {directory}: tiny-beta: the name 'tiny-beta' is given twice (the first is "
        "served)"]
    assert all(r.in_directory for r in refused)
    # The front's start: the directory's refusals are the worker's to log, not a flag error.
    assert [f.name for f in resolve_finetunes([str(directory)], ("clef-flash",))] == [
        "flash", "tiny-alpha", "tiny-beta"]


def test_the_worker_receives_every_finetune() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    args = parser.parse_args(["--finetune", "a=/x", "--finetune", "/dir"])
    again = parser.parse_args(worker_argv(args))
    assert again.finetune == ["a=/x", "/dir"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--finetune", "bad name=/x"])


# -- refusals ---------------------------------------------------------------------------------


def _broken(tmp_path: Path, change: Callable[[Path], object]) -> Finetune:
    checkpoint = tmp_path / "broken"
    shutil.copytree(FINETUNE_FIXTURES / "tiny-alpha", checkpoint)
    change(checkpoint)
    return Finetune("broken", checkpoint)


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _config(checkpoint: Path, **changes: Any) -> bool:
    path = checkpoint / "adapter" / "adapter_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **changes)))
    return True


def _drop_up_proj(checkpoint: Path) -> bool:
    """Layer 0's up_proj left out of the adapter file (target_modules still names it)."""
    _rewrite(checkpoint / "adapter" / "adapter_model.safetensors",
             lambda t: [t.pop(KEY_PREFIX + f"layers.0.mlp.up_proj.lora_{x}.weight")
                        for x in "AB"])
    return True


QKV_A = KEY_PREFIX + "layers.0.linear_attn.in_proj_qkv.lora_A.weight"
REFUSALS: dict[str, tuple[Callable[[Path], object], str]] = {
    "no adapter config": (lambda c: (c / "adapter" / "adapter_config.json").unlink(),
                          r"adapter_config\.json: missing"),
    "dora": (lambda c: _config(c, use_dora=True),
             r"adapter_config\.json: use_dora is true: DoRA"),
    "outside target_modules": (
        lambda c: _config(c, target_modules=r"model\.language_model\.layers\.0\..*"),
        r"tensor base_model\.model\.model\.language_model\.layers\.1\.\S+ adapts "
        r"model\.language_model\.layers\.1\.\S+, which target_modules does not name"),
    "a pattern found inside names, not matching them whole": (
        lambda c: _config(c, target_modules="mlp"), r"which target_modules does not name"),
    "a list entry no name ends in after a dot": (
        lambda c: _config(c, target_modules=["proj", "linear_attn", "self_attn", "mlp"]),
        r"which target_modules does not name"),
    "random init, a targeted module without tensors": (
        lambda c: (_config(c, init_lora_weights=False), _drop_up_proj(c)),
        r"model\.language_model\.layers\.0\.mlp\.up_proj is named by target_modules but has "
        r"no tensors: with this init_lora_weights PEFT would give it random factors"),
    "rank": (lambda c: _config(c, r=8),
             r"adapter_model\.safetensors: tensor .*lora_A\.weight has shape \[4, 64\], expected "
             r"\[8, 64\]"),
    "shape": (lambda c: _rewrite(c / "adapter" / "adapter_model.safetensors",
                                 lambda t: t.__setitem__(QKV_A, torch.zeros(4, 32))),
              rf"adapter_model\.safetensors: tensor {QKV_A} has shape \[4, 32\]"),
    "missing B": (lambda c: _rewrite(c / "adapter" / "adapter_model.safetensors",
                                     lambda t: t.pop(QKV_A.replace("lora_A", "lora_B"))),
                  r"in_proj_qkv\.lora_B\.weight is missing"),
    "vision": (lambda c: _rewrite(c / "adapter" / "adapter_model.safetensors",
                                  lambda t: t.__setitem__(
                                      "base_model.model.model.visual.blocks.0.mlp.linear_fc1."
                                      "lora_A.weight", torch.zeros(4, 32))),
               r"tensor base_model\.model\.model\.visual\.blocks\.0\.mlp\.linear_fc1\.lora_A\."
               r"weight is not a LoRA A or B of the text stack"),
    "unknown module": (lambda c: _rewrite(c / "adapter" / "adapter_model.safetensors",
                                          lambda t: t.__setitem__(
                                              KEY_PREFIX + "layers.9.mlp.up_proj.lora_A.weight",
                                              torch.zeros(4, 64))),
                       r"adapts layers\.9\.mlp\.up_proj, which is not a linear layer"),
    "nan": (lambda c: _rewrite(c / "adapter" / "adapter_model.safetensors",
                               lambda t: t[QKV_A].fill_(float("nan"))),
            rf"tensor {QKV_A} holds NaN"),
    "head missing": (lambda c: _rewrite(c / "joint_head.safetensors",
                                        lambda t: t.pop("residual_gate")),
                     r"joint_head\.safetensors: tensor residual_gate is missing"),
    "head shape": (lambda c: _rewrite(c / "joint_head.safetensors",
                                      lambda t: t.__setitem__("type_embedding.weight",
                                                              torch.zeros(3, 16))),
                   r"joint_head\.safetensors: tensor type_embedding\.weight has shape \[3, 16\]"),
    "head extra": (lambda c: _rewrite(c / "joint_head.safetensors",
                                      lambda t: t.__setitem__("extra", torch.zeros(1))),
                   r"tensor extra is not a tensor of the base head"),
    "not safetensors": (lambda c: (c / "joint_head.safetensors").write_bytes(b"junk"),
                        r"joint_head\.safetensors: cannot read it as safetensors"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_bad_checkpoints_are_refused_naming_file_and_tensor(
        executor: NativeExecutor, tmp_path: Path, name: str) -> None:
    """Checked against the loaded base before anything is attached (so the module's executor
    is left as it was: `load_variants` checks every checkpoint first)."""
    change, message = REFUSALS[name]
    finetune = _broken(tmp_path, change)
    assert executor.runner.selection is not None
    with pytest.raises(StartupError, match=message):
        load_variants([finetune], executor.backbone, executor.head, executor.runner.selection)


def test_a_bad_checkpoint_is_refused_and_the_rest_served(
        tiny_snapshot: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker's start (or roll, or replacement after a crash) with one checkpoint gone bad:
    that one is refused with an ERROR naming it and the file, the others are served in their
    slots, so the server never stops for it."""
    broken = _broken(tmp_path, lambda c: (c / "joint_head.safetensors").write_bytes(b"junk"))
    beta = Finetune("tiny-beta", FINETUNE_FIXTURES / "tiny-beta")
    caplog.set_level(logging.ERROR, logger="clef_worker.variants")
    loaded = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               finetunes=(broken, beta))
    assert [item["name"] for item in loaded.describe().finetunes] == ["tiny-beta"]
    assert loaded.variants["tiny-beta"].slot == 1
    [line] = [r.getMessage() for r in caplog.records if r.name == "clef_worker.variants"]
    assert line.startswith("variant broken refused, not served: ")
    assert "joint_head.safetensors: cannot read it as safetensors" in line


def test_training_state_is_never_unpickled(tiny_snapshot: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint as clef-finetune writes it holds `training_state.pt`; loading must not open
    it (a pickle runs code)."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("something was unpickled")

    finetune = _broken(tmp_path, lambda c: (c / "training_state.pt").write_bytes(
        pickle.dumps({"optimizer": {}})))
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    loaded = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                               finetunes=(finetune,))
    assert [item["name"] for item in loaded.describe().finetunes] == ["broken"]


def test_packed_graph_buckets_replay_the_stacked_path(tiny_snapshot: Path) -> None:
    """`--cuda-graphs on` on CPU builds the packed buckets eagerly through the same code a CUDA
    capture records: the stacked path over each bucket's static slot buffer, rewritten before
    every replay. Mixed groups, then a base-only group on the same bucket (its slots must be
    rewritten to the base's), each equal to the request alone without graphs."""
    plain = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32",
                              finetunes=_finetunes())
    graphs = assemble_snapshot(tiny_snapshot, device="cpu", dtype="float32", cuda_graphs="on",
                               max_batch_tokens=4096, graph_max_length=2048,
                               finetunes=_finetunes())
    graphs.warm_up()
    assert graphs.runner.graphs is not None and graphs.runner.selection is not None
    assert graphs.runner.selection.mode != STACKED  # the buckets force it, not the mode
    bodies = _mixed_bodies()[:4]
    alone = _alone(plain, bodies)
    staged = graphs.stage([graphs.prepare(body) for body in bodies])
    assert staged[1].bucket is not None and staged[1].bucket_slots
    for got, want in zip(graphs.answer_staged(staged), alone, strict=True):
        assert_same_response(got.body, want)
    base_only = [json.dumps(dict(json.loads(body), model="clef-flash")).encode()
                 for body in bodies]
    for got, want in zip(graphs.answer_prepared([graphs.prepare(b) for b in base_only]),
                         _alone(plain, base_only), strict=True):
        assert_same_response(got.body, want)

"""A variant's `adapter_config.json` (clef_worker.adapter_config): every PEFT field decided,
each refused value refused naming the field, every served value read as PEFT reads it,
`target_modules` matched as PEFT matches it, and docs/finetune.md's table the same as the
code's.

The served checkpoint's config is the fixture's (tests/fixtures/finetune/tiny-alpha, as PEFT
0.21 saved it); each case changes one field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchlib.paths import FINETUNE_FIXTURES, TINY_SNAPSHOT
from clef_worker.adapter_config import FIELDS, REQUIRED, names_the_base, read_lora_config
from clef_worker.errors import StartupError

FIXTURE_CONFIG = json.loads(
    (FINETUNE_FIXTURES / "tiny-alpha" / "adapter" / "adapter_config.json").read_text())
DOCS = Path(__file__).resolve().parents[1] / "docs" / "finetune.md"

# One refused value per field that refuses any, as PEFT would save it (`init_lora_weights` and
# `bias` have several).
REFUSED: list[tuple[str, Any]] = [
    ("peft_type", "LOHA"), ("r", 0), ("r", 2.5), ("lora_alpha", 0), ("lora_alpha", "8"),
    ("use_rslora", "yes"), ("target_modules", "(unclosed"), ("target_modules", None),
    ("target_modules", ["q_proj", 3]), ("lora_dropout", 1.5),
    ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"), ("init_lora_weights", "corda"),
    ("init_lora_weights", "loftq"), ("init_lora_weights", "lora_ga"),
    ("init_lora_weights", "something-new"),
    ("bias", "all"), ("bias", "lora_only"), ("lora_bias", True),
    ("modules_to_save", ["score"]), ("layers_to_transform", [0, 1]),
    ("layers_pattern", "layers"), ("rank_pattern", {"up_proj": 8}),
    ("alpha_pattern", {"up_proj": 16}), ("exclude_modules", ["down_proj"]),
    ("exclude_modules", ".*down_proj"), ("target_parameters", ["experts.gate_up_proj"]),
    ("trainable_token_indices", [0, 1]), ("layer_replication", [[0, 2], [1, 4]]),
    ("use_dora", True), ("alora_invocation_tokens", [151644, 77091]), ("use_qalora", True),
    ("megatron_config", {"tensor_model_parallel_size": 2}), ("use_bdlora", {"nblocks": 2}),
    ("arrow_config", {"top_k": 3}), ("kasa_config", {"beta": 1e-4}),
    ("monteclora_config", {"num_samples": 4}), ("velora_config", {"num_groups": 32}),
    ("a_field_from_a_newer_peft", True), ("a_field_from_a_newer_peft", "on"),
]
# Values PEFT runs with the plain LoRA forward applied here (with the loaded A and B).
SERVED: list[tuple[str, Any]] = [
    ("fan_in_fan_out", True), ("lora_dropout", 0.1), ("init_lora_weights", False),
    ("init_lora_weights", "gaussian"), ("init_lora_weights", "eva"),
    ("init_lora_weights", "orthogonal"), ("init_lora_weights", "mica"),
    ("task_type", "CAUSAL_LM"), ("inference_mode", False), ("revision", "main"),
    ("qalora_group_size", 32), ("megatron_core", "megatron.core"),
    ("eva_config", {"rho": 2.0}), ("corda_config", {"corda_method": "ipm"}),
    ("loftq_config", {"loftq_bits": 4}), ("lora_ga_config", {"direction": "ArB2r"}),
    ("ensure_weight_tying", True), ("base_model_name_or_path", "Qwen/Qwen3.5-9B"),
    ("target_modules", "all-linear"), ("target_modules", ["up_proj", "down_proj"]),
    ("use_rslora", True), ("a_field_from_a_newer_peft", None),
    ("a_field_from_a_newer_peft", []), ("a_field_from_a_newer_peft", False),
]


def _written(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps(dict(FIXTURE_CONFIG, **changes)))
    return path


def test_the_fixture_config_is_served_as_written() -> None:
    config = read_lora_config(FINETUNE_FIXTURES / "tiny-alpha" / "adapter" /
                              "adapter_config.json")
    assert (config.rank, config.alpha, config.scale, config.rslora) == (4, 8.0, 2.0, False)
    assert config.base_model == "tests/fixtures/clef-tiny" and not config.random_init


def test_every_field_peft_saves_is_decided() -> None:
    """Each field of the fixture's config (all PEFT 0.21 saves) has a rule, and each rule that
    refuses any value has a refused case here."""
    assert set(FIXTURE_CONFIG) <= set(FIELDS)
    refusing = {name for name, rule in FIELDS.items() if rule.served != "any"}
    assert refusing <= {name for name, _ in REFUSED}


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_each_refused_value_is_refused_naming_the_field(tmp_path: Path, field: str,
                                                       value: Any) -> None:
    path = _written(tmp_path, **{field: value})
    with pytest.raises(StartupError,
                       match=rf"adapter_config\.json: {field} is {re.escape(json.dumps(value))}: "):
        read_lora_config(path)


@pytest.mark.parametrize(("field", "value"), SERVED, ids=[f"{f}={v!r}" for f, v in SERVED])
def test_each_served_value_is_served(tmp_path: Path, field: str, value: Any) -> None:
    config = read_lora_config(_written(tmp_path, **{field: value}))
    assert config.rank == 4


@pytest.mark.parametrize("field", REQUIRED)
def test_a_required_field_missing_is_refused(tmp_path: Path, field: str) -> None:
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({k: v for k, v in FIXTURE_CONFIG.items() if k != field}))
    with pytest.raises(StartupError, match=rf"adapter_config\.json: {field} is missing"):
        read_lora_config(path)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path) -> None:
    config = read_lora_config(_written(tmp_path, use_rslora=True, r=16, lora_alpha=8))
    assert config.scale == 2.0
    assert read_lora_config(_written(tmp_path, r=16, lora_alpha=8)).scale == 0.5


def test_random_inits_are_told_apart(tmp_path: Path) -> None:
    for value, random in [(True, False), (False, True), ("orthogonal", True),
                          ("gaussian", False), ("eva", False), ("mica", False)]:
        assert read_lora_config(_written(tmp_path, init_lora_weights=value)).random_init \
            is random, value


def test_target_modules_match_as_peft_matches_them(tmp_path: Path) -> None:
    """A string: the whole name matches the expression; a list: the name itself, or ending in
    `.entry`; `all-linear`: every (linear) layer."""
    name = "model.language_model.layers.0.mlp.up_proj"

    def targets(value: Any) -> bool:
        return read_lora_config(_written(tmp_path, target_modules=value)).targets(name)

    assert targets(r".*\.mlp\.up_proj") and targets(name) and targets(FIXTURE_CONFIG[
        "target_modules"])
    assert not targets("mlp") and not targets(r"layers\.0\.mlp\.up_proj")  # found, not whole
    assert targets(["up_proj"]) and targets(["mlp.up_proj"]) and targets([name])
    assert not targets(["proj"]) and not targets(["p_proj"]) and not targets([])
    assert targets("all-linear") and targets("ALL-LINEAR")


def test_names_the_base() -> None:
    assert names_the_base("tests/fixtures/clef-tiny", ("clef-flash",), TINY_SNAPSHOT)
    assert names_the_base(str(TINY_SNAPSHOT), (), TINY_SNAPSHOT)
    assert names_the_base("cloudflare/clef-flash", ("clef-flash",), TINY_SNAPSHOT)
    assert names_the_base("/srv/models/clef-tiny/", (), TINY_SNAPSHOT)
    assert not names_the_base("Qwen/Qwen3.5-9B", ("clef-flash",), TINY_SNAPSHOT)


def test_the_docs_table_lists_every_field_as_decided() -> None:
    """docs/finetune.md's table of adapter-config fields: one row per field of `FIELDS`, each
    saying the values served as the code does."""
    rows = {}
    section = DOCS.read_text().split("## The adapter configuration", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[1]
    assert set(rows) == set(FIELDS)
    for name, rule in FIELDS.items():
        assert rows[name] == rule.served.replace("|", "\\|"), name

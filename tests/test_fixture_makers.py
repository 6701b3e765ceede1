"""The fixtures' makers (tests/fixtures/README.md): each writes to a new place, refuses to write
over its input, and compares what it made with the checked-in fixture.

The tiny snapshot's maker runs here in full (a few seconds): its layout must be clef-tiny's, and
the snapshot it makes must load and answer. The golden file's remake is exercised on a sample by
tests/test_golden_reference.py (the same comparison); here only its refusal to overwrite. The
fine-tune maker needs peft and minutes of training, so only its argument checks and its
comparison run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from benchlib.golden import answered
from benchlib.paths import FINETUNE_FIXTURES, GOLDEN, TINY_SNAPSHOT
from tests.conftest import REPO
from tests.upstream import UPSTREAM_PIN

FIXTURES = REPO / "tests" / "fixtures"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO,
                          timeout=600, check=False)


@pytest.fixture(scope="module")
def made_snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("made") / "clef-tiny"
    result = run(str(FIXTURES / "make_tiny_snapshot.py"), "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result.stdout


def test_the_tiny_snapshot_maker_gives_clef_tiny_s_layout(made_snapshot: tuple[Path, str]
                                                           ) -> None:
    out, report = made_snapshot
    assert "MISMATCH" not in report and "the same layout as" in report
    # what cannot be the same is said to differ, not passed over
    assert "model.safetensors: 77 tensors, same names, shapes and dtypes" in report
    assert {path.name for path in out.iterdir()} == {path.name for path in TINY_SNAPSHOT.iterdir()}


def test_the_made_snapshot_serves(made_snapshot: tuple[Path, str]) -> None:
    """Same layout is not enough: the executor loads what the maker wrote and answers a golden
    request with a body of the golden answer's shape."""
    from clef_protocol.options import RequestLimits
    from clef_worker.assembly import assemble_snapshot

    out, _ = made_snapshot
    executor = assemble_snapshot(out, device="cpu", dtype="float32", gdn_prefill="torch",
                                 limits=RequestLimits())
    case = answered()[0]
    scored = executor.score(case["request"])
    assert len(scored.probabilities) == sum(len(q["option_ids"]) for q in case["questions"])
    assert scored.response().keys() == case["response"].keys()


def test_the_tiny_snapshot_maker_finds_a_drifted_layout(made_snapshot: tuple[Path, str],
                                                        tmp_path: Path) -> None:
    """Its comparison can fail: a copy of clef-tiny with one configuration value changed."""
    drifted = tmp_path / "drifted"
    drifted.mkdir()
    for path in TINY_SNAPSHOT.iterdir():
        (drifted / path.name).write_bytes(path.read_bytes())
    config = json.loads((drifted / "joint_head_config.json").read_text())
    (drifted / "joint_head_config.json").write_text(json.dumps(dict(config, heads=8)))
    result = run(str(FIXTURES / "make_tiny_snapshot.py"), "--out", str(tmp_path / "new"),
                 "--against", str(drifted))
    assert result.returncode == 1
    assert "MISMATCH: joint_head_config.json: differs" in result.stdout


@pytest.mark.parametrize("argv", [
    ("tests/fixtures/make_tiny_snapshot.py", "--out", str(TINY_SNAPSHOT)),
    ("-m", "tests.golden_reference", "--out", str(GOLDEN)),
    ("tests/fixtures/finetune/make_variants.py", "--out", str(FINETUNE_FIXTURES)),
])
def test_no_maker_writes_over_its_input(argv: tuple[str, ...]) -> None:
    before = {path: path.stat().st_mtime_ns for path in FIXTURES.rglob("*") if path.is_file()}
    result = run(*argv)
    assert result.returncode == 2, result.stderr  # argparse's refusal, before any work
    assert "--out" in result.stderr or "exists" in result.stderr
    assert before == {path: path.stat().st_mtime_ns for path in FIXTURES.rglob("*")
                      if path.is_file()}


def test_the_fine_tune_comparison_accepts_the_fixtures_and_finds_a_change(tmp_path: Path) -> None:
    """make_variants.compare on the checked-in fixtures against themselves finds nothing, and
    finds a changed configuration and an answer whose top option moved; tensor values are
    reported, not compared (training is not reproducible to the bit)."""
    import shutil

    sys.path.insert(0, str(FINETUNE_FIXTURES))
    try:
        import make_variants
    finally:
        sys.path.remove(str(FINETUNE_FIXTURES))
    copy = tmp_path / "copy"
    shutil.copytree(FINETUNE_FIXTURES, copy, ignore=shutil.ignore_patterns("__pycache__", "*.py",
                                                                             "README.md"))
    problems, notes = make_variants.compare(copy, FINETUNE_FIXTURES)
    assert problems == []
    assert "tiny-alpha/joint_head.safetensors: same tensors, values within 0.0e+00" in notes
    config = copy / "tiny-beta" / "adapter" / "adapter_config.json"
    config.write_text(json.dumps(dict(json.loads(config.read_text()), r=8)))
    rows = (copy / "reference.jsonl").read_text().splitlines()
    first = json.loads(rows[0])
    probabilities = first["questions"][0]["probabilities"]
    low = min(range(len(probabilities)), key=probabilities.__getitem__)
    probabilities[low] = 2.0  # another option on top
    (copy / "reference.jsonl").write_text("\n".join([json.dumps(first), *rows[1:]]) + "\n")
    problems, _ = make_variants.compare(copy, FINETUNE_FIXTURES)
    assert "tiny-beta/adapter/adapter_config.json: differs" in problems
    assert any(problem.startswith(f"reference.jsonl {first['variant']} {first['name']}")
               and "top option" in problem for problem in problems)


def test_the_pins_the_makers_name_are_the_project_s() -> None:
    """peft (the fine-tune maker) and clef-finetune (the reference) are pinned in pyproject's
    extras, and the fine-tune fixtures were saved by that peft."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["upstream"] == [UPSTREAM_PIN]
    [peft] = extras["fixtures"]
    saved = json.loads((FINETUNE_FIXTURES / "tiny-alpha" / "adapter" /
                        "adapter_config.json").read_text())["peft_version"]
    assert peft == f"peft=={saved}"

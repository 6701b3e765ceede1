"""Every figure in docs/, the README and bench/results/README.md names its raw output or the
command that makes it (tests/docs_figures.py has the labels), and every figure whose label names
the value in its raw file agrees with that file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs_figures import Keyed, disagreements, keyed, labels, unlabelled

DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
        REPO / "bench" / "results" / "README.md"]


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_figure_names_its_raw_output_or_command(doc: Path) -> None:
    assert unlabelled(doc.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_named_file_exists(doc: Path) -> None:
    """A `raw` label names a kept file under bench/results/; a `set` label a file of the
    repository."""
    missing = []
    for kind, body in labels(doc.read_text(encoding="utf-8")):
        if kind in ("raw", "set"):
            path = body.split()[0]
            if kind == "raw" and not path.startswith("bench/results/"):
                missing.append(f"{path}: raw output lives under bench/results/")
            elif not (REPO / path).exists():
                missing.append(path)
    assert missing == []


def test_every_keyed_figure_agrees_with_its_raw_file() -> None:
    items = [item for doc in DOCS for item in keyed(_name(doc), doc.read_text(encoding="utf-8"))]
    assert len(items) >= 20, "the H200 sitting's figures in docs/benchmarks.md are keyed"
    assert disagreements(items, REPO) == []


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_every_keyed_label_stands_right_after_its_figure(doc: Path) -> None:
    """A label with a key that follows no figure directly would be checked against nothing."""
    text = doc.read_text(encoding="utf-8")
    with_key = Counter(body for kind, body in labels(text) if kind == "raw" and " " in body)
    checked = Counter(f"{item.path} {item.key}" for item in keyed(_name(doc), text))
    assert with_key - checked == Counter()


# -- the check itself -----------------------------------------------------------------------------


def test_a_figure_its_raw_file_says_otherwise_about_fails(tmp_path: Path) -> None:
    raw = tmp_path / "bench" / "results" / "run.json"
    raw.parent.mkdir(parents=True)
    raw.write_text(json.dumps({"latency": {"p50_ms": 25.34}, "ready_ms": 63125.3}))
    steps = tmp_path / "bench" / "results" / "steps.jsonl"
    steps.write_text(json.dumps({"name": "warm", "result": {"ms": 3605.3}}) + "\n")
    good = ("p50 25.34 ms [raw: bench/results/run.json latency.p50_ms], ready in 63.1 s "
            "[raw: bench/results/run.json ready_ms/1000], warm 3.6 s "
            "[raw: bench/results/steps.jsonl warm.result.ms/1000].")
    assert [item.figure for item in keyed("d.md", good)] == ["25.34", "63.1", "3.6"]
    assert disagreements(keyed("d.md", good), tmp_path) == []
    wrong = good.replace("25.34 ms", "20.1 ms").replace("63.1 s", "60 s")
    found = disagreements(keyed("d.md", wrong), tmp_path)
    assert len(found) == 2 and "20.1 but bench/results/run.json latency.p50_ms = 25.34" in found[0]
    absent = disagreements([Keyed("d.md", "1", "bench/results/run.json", "p99_ms")], tmp_path)
    assert len(absent) == 1 and "p99_ms" in absent[0]


def test_a_changed_figure_of_the_real_docs_fails() -> None:
    """The H200 sitting's p50 at 370 tokens, changed in docs/benchmarks.md's text, no longer
    agrees with the summary it names."""
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert "25.34 ms [raw: " in text
    changed = text.replace("25.34 ms [raw: ", "19.5 ms [raw: ", 1)
    assert disagreements(keyed("docs/benchmarks.md", changed), REPO) != []


def test_an_unlabelled_figure_is_found() -> None:
    text = ("Intro.\n\nThe p50 was 12.5 ms on the H200.\n\nA setting of 30 s is no figure.\n\n"
            "Labelled: 3.2 ms [cmd: python bench/x.py].\n\n"
            "Caption [raw: bench/results/x.json]:\n\n| a | b |\n|---|---|\n| 1 | 4.5 ms |\n\n"
            "| c |\n|---|\n| 7.5 ms |\n\n```\nin code 9.9 ms\n```\n\n- item 1.2× [set: x.py]\n"
            "- item 2.5×\n")
    found = unlabelled(text)
    assert len(found) == 3, found
    assert found[0].startswith("12.5 ms") and found[1].startswith("7.5 ms")
    assert found[2].startswith("2.5×")

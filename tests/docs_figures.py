"""Every figure in the docs names where it comes from, and a figure whose raw file holds it agrees
with that file.

The labels (docs/benchmarks.md, "Where each figure comes from", says the same for writers):

- `[raw: bench/results/FILE]`: the figures before it, in its block, come from that kept file.
- `[raw: bench/results/FILE KEY]`, right after one figure: that figure is the value at KEY in the
  file, rounded to the figure's decimals. KEY is a dotted path (`latency.p50_ms`, list items by
  index); in a `.jsonl` file its first part picks the line whose `name` is that part (or the line
  by index). A KEY may end in `/1000` or `*1000` when the doc's unit differs from the file's
  (`self_check_ms/1000` for seconds).
- `[cmd: COMMAND]`: no raw file was kept; COMMAND makes the figures again.
- `[set: PATH]`: not a measurement but a setting, a bound or a paper estimate, written in that
  file of the repository.
- `[cited: SOURCE]`: someone else's published figure, and where it is published.

A block is a paragraph, a list item or a table; a table's label may also stand in the paragraph
right above it (its caption). A section that a benchmark writes (between its `<!-- bench-… -->`
markers, benchlib/docs_writer.py) is one block: its command and its `Raw output:` or
`No raw output kept` line label it. Code blocks and inline code are not figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchlib.docs_writer import NO_RAW_OUTPUT, RAW_OUTPUT

LABEL = re.compile(r"\[(raw|cmd|set|cited): ([^\]]+)\]")
# A measured figure: a number with a unit of time, rate or ratio ("2.7 times" too); seconds only
# with decimals or as a range (a bare "30 s" is a setting, not a measurement).
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?[–-]\s?\d[\d,]*(?:\.\d+)?)?\s?"
    r"(?:ms|µs|req/s|requests/s|GiB/s|GB/s|TB/s|×)(?![\w])"
    r"|(?<![\w.])\d+\.\d+ times\b"
    r"|(?<![\w.])\d+(?:\.\d+\s?(?:[–-]\s?\d+(?:\.\d+)?\s?)?|\s?[–-]\s?\d+(?:\.\d+)?\s?)s\b")
# A keyed label and the figure right before it (its unit between them, if any).
KEYED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?"
                   r"(?:ms|µs|s|req/s|requests/s|GiB/s|GB/s|TB/s|×|%|MiB|GiB)?"
                   r"\s*\[raw: (\S+) (\S+)\]")
SCALE = re.compile(r"^(.*?)([/*])(\d+(?:\.\d+)?)$")
GENERATED = re.compile(r"<!-- (bench-[\w-]+:[\w-]+) -->(.*?)<!-- /\1 -->", re.DOTALL)
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class Keyed:
    """A figure whose label names the value it must equal."""

    doc: str
    figure: str
    path: str
    key: str


def blocks(text: str) -> list[str]:
    """The doc's blocks, with code blocks left out and each generated section kept whole."""
    text = FENCE.sub("", text)
    found = [match.group(0) for match in GENERATED.finditer(text)]
    rest = GENERATED.sub("\n\n", text)
    for part in re.split(r"\n\s*\n", rest):
        # A list item starts a block of its own, even without a blank line before it (its
        # nested items stay with it).
        items = re.split(r"\n(?=(?:[-*]|\d+\.) )", part.strip("\n"))
        found.extend(item for item in items if item.strip() and not item.startswith("#"))
    return found


def figures(block: str) -> list[str]:
    """The measured figures of a block, inline code and labels aside."""
    return FIGURE.findall(LABEL.sub("", CODE.sub("", block)))


def labelled(block: str, caption: str) -> bool:
    if LABEL.search(block):
        return True
    if block.startswith("<!-- bench-"):
        return RAW_OUTPUT in block or NO_RAW_OUTPUT in block
    return block.lstrip().startswith("|") and bool(LABEL.search(caption))


def unlabelled(text: str) -> list[str]:
    """The figures of blocks that name neither a raw file nor a command."""
    missing, previous = [], ""
    for block in blocks(text):
        found = figures(block)
        if found and not labelled(block, previous):
            missing.append(f"{', '.join(found[:3])} in: {block.strip()[:100]!r}")
        previous = block
    return missing


def labels(text: str) -> list[tuple[str, str]]:
    """Every (kind, body) label of a doc, code blocks aside."""
    return [(kind, body.strip())
            for kind, body in LABEL.findall(CODE.sub("", FENCE.sub("", text)))]


def keyed(doc: str, text: str) -> list[Keyed]:
    """The keyed figures of a doc, code blocks and inline code aside."""
    text = CODE.sub("", FENCE.sub("", text))
    return [Keyed(doc, figure, path, key) for figure, path, key in KEYED.findall(text)]


def _record(path: Path, first: str) -> tuple[Any, bool]:
    """A `.jsonl` file's line named by `first` (its `name`, or its index), else the whole JSON."""
    if path.suffix != ".jsonl":
        return json.loads(path.read_text(encoding="utf-8")), False
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    if first.isdigit():
        return lines[int(first)], True
    named = [line for line in lines if isinstance(line, dict) and line.get("name") == first]
    if len(named) != 1:
        raise KeyError(f"{path.name} has {len(named)} lines named {first!r}")
    return named[0], True


def value(path: Path, key: str) -> float:
    """The number at `key` in a raw JSON or JSONL file, its scale applied."""
    scale = SCALE.match(key)
    factor = 1.0
    if scale:
        key, op, amount = scale.group(1), scale.group(2), float(scale.group(3))
        factor = 1 / amount if op == "/" else amount
    parts = key.split(".")
    node, used_first = _record(path, parts[0])
    for part in parts[1:] if used_first else parts:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, bool) or not isinstance(node, int | float | str):
        raise TypeError(f"{path.name} {key}: {node!r} is not a number")
    return float(node) * factor


def agrees(figure: str, raw: float) -> bool:
    """The doc's figure is the raw value rounded to the figure's decimals."""
    number = figure.replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return abs(raw - float(number)) <= 0.5 * 10 ** -decimals + 1e-9


def disagreements(items: list[Keyed], root: Path) -> list[str]:
    """Each keyed figure that its raw file says otherwise about, or whose key is not there."""
    wrong = []
    for item in items:
        try:
            raw = value(root / item.path, item.key)
        except (OSError, KeyError, IndexError, TypeError, ValueError) as error:
            wrong.append(f"{item.doc}: {item.figure} [{item.path} {item.key}]: {error}")
            continue
        if not agrees(item.figure, raw):
            wrong.append(f"{item.doc}: {item.figure} but {item.path} {item.key} = {raw:g}")
    return wrong

"""The one writer of docs/benchmarks.md, off by default.

A benchmark prints its section; only when asked (`--write-docs`) does it replace the section
between its markers in docs/benchmarks.md (or append it where the markers are not there yet).
Off by default so that a run for a look, a CI quick run or a run on a busy machine never
rewrites published numbers by accident.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchlib.paths import REPO

DOC = REPO / "docs" / "benchmarks.md"


RAW_OUTPUT = "Raw output:"
NO_RAW_OUTPUT = "No raw output kept"
"""A generated section of docs/benchmarks.md says where its raw output is, under bench/results/,
or that none was kept: that line labels the section's figures (tests/docs_figures.py, which
also checks every hand-written figure's own label; tests/test_benchmarks_doc.py that every cited
file exists)."""


def raw_output_line(path: str | None) -> str:
    """The line a generated section ends with: its raw output's file, or that there is none."""
    if path:
        return f"{RAW_OUTPUT} `{path}`."
    return (f"{NO_RAW_OUTPUT}: this section is the run's only record (the script printed it; "
            "run the command above again to check it).")


def add_write_docs_flag(parser: argparse.ArgumentParser) -> None:
    """`--write-docs`: the only way a benchmark touches docs/benchmarks.md."""
    parser.add_argument("--write-docs", action="store_true",
                        help="also replace this benchmark's section of docs/benchmarks.md "
                             "(default: print only)")


def replace_section(section: str, begin: str, end: str, doc: Path = DOC,
                    header: str = "") -> None:
    """Put `section` (which starts with `begin` and ends with `end` and a newline) in place of
    the text between the same markers in `doc`, or at its end when they are absent."""
    if not (section.startswith(begin) and section.rstrip("\n").endswith(end)):
        raise ValueError("a section must start and end with its own markers")
    text = doc.read_text(encoding="utf-8") if doc.exists() else header
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end) + "\n?", re.DOTALL)
    body = section if section.endswith("\n") else section + "\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")

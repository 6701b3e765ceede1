"""docs/protocol.md's list of the flags the front passes to the worker is the list
`clef_protocol.options.add_model_arguments` defines, in its order."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from clef_protocol.options import add_model_arguments

PROTOCOL = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def test_the_documented_shared_flags_are_the_defined_ones() -> None:
    text = PROTOCOL.read_text()
    listed = re.search(r"defines the model and limit flags once:\n`([^`]+)`", text)
    assert listed is not None, "docs/protocol.md: the shared-flag list is missing"
    parser = argparse.ArgumentParser(add_help=False)
    add_model_arguments(parser)
    defined = [action.option_strings[0] for action in parser._actions]
    assert listed.group(1).split() == defined

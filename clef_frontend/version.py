"""The installed clef-serve version (`--version`, the `clef_build_info` metric)."""

from __future__ import annotations

import importlib.metadata

from clef_protocol.build_info import commit


def version() -> str:
    try:
        return importlib.metadata.version("clef-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def describe() -> str:
    """`--version`'s line: the version, and the commit when it is known (build_info says how)."""
    built_from = commit()
    return f"clef-serve {version()}" + (f" (commit {built_from})" if built_from else "")

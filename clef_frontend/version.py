"""The installed clef-serve version (`--version`, the `clef_build_info` metric)."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    try:
        return importlib.metadata.version("clef-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"

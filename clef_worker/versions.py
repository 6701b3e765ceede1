"""Installed package versions: what `ready` reports and what fingerprints the demo snapshot.

One collector, so every place that reports a version spells a missing package the same way.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable

ABSENT = "absent"

# The libraries whose versions shape the model's numbers (and the demo snapshot's bytes).
MODEL_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors")


def package_version(distribution: str) -> str:
    """The installed version of a distribution, or `absent`."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ABSENT


def package_versions(distributions: Iterable[str] = MODEL_LIBRARIES) -> dict[str, str]:
    """Distribution name -> installed version (or `absent`), in the order given."""
    return {name: package_version(name) for name in distributions}

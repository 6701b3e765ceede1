"""docs/operations.md's `/health` example has the fields a live server reports, no more and no
fewer: the real worker on the tiny snapshot (CPU) behind clef-serve with its defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchlib.paths import TINY_SNAPSHOT
from tests.frontend_helpers import Serve

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def _documented() -> dict[str, Any]:
    text = OPERATIONS.read_text()
    section = text[text.index("## Health checks and load balancers"):]
    start = section.index("```json\n") + len("```json\n")
    return json.loads(section[start:section.index("```", start)])


def test_the_documented_health_example_has_the_live_fields() -> None:
    documented = _documented()
    with Serve(real_worker=True, startup_wait=240,
               front_args=("--model", str(TINY_SNAPSHOT), "--device", "cpu")) as serve:
        live = serve.health().json()
    assert documented["status"] == live["status"] == "ready"
    assert set(documented) == set(live)
    assert set(documented["worker"]) == set(live["worker"])
    for worker in documented["workers"]:
        assert set(worker) == set(live["workers"][0])
    for key, value in live.items():  # the same JSON types (null where nothing is waited for)
        assert isinstance(documented[key], type(value)) or documented[key] is None, key

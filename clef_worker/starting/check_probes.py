"""Every probe of the start-up self-check, in the order run: the one list both the check
(clef_worker.starting.self_check.run_self_check) and the kept verdict's key
(clef_worker.starting.verdict_store,
by name) read, so a probe added is run and changes the key at once.

Why a module of its own: the probes of things beside the layout build on the check's
comparison (clef_worker.starting.self_check), so listing them there would import them back into it.
"""

from __future__ import annotations

from clef_worker.starting.prefix_probe import PROBE_NAME, probe_prefix, turn_cache_off
from clef_worker.starting.self_check import LAYOUT_PROBES, Probe

PROBES: tuple[Probe, ...] = (
    *LAYOUT_PROBES,
    # After the layout is settled, on the path the worker serves with; its remedy turns the
    # cache off, the serving layout stays.
    Probe(PROBE_NAME, probe_prefix, layout=False, remedy=turn_cache_off),
)

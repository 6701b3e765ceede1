"""The sitting's summary judges its own targets: a field at its bound is met, past it missed, a
null field not measured (never met), whichever way the bound points."""

from __future__ import annotations

from benchlib.gpu_steps import SUMMARY_FIELDS
from benchlib.gpu_targets import AT_LEAST, AT_MOST, TARGETS, judge


def test_every_target_names_a_summary_field() -> None:
    assert set(TARGETS) <= set(SUMMARY_FIELDS)


def test_bounds_are_judged_in_their_direction() -> None:
    targets = {"latency": (AT_MOST, 15.0), "rate": (AT_LEAST, 90.0)}
    assert judge({"latency": 15.0, "rate": 90}, targets) == {"latency": True, "rate": True}
    assert judge({"latency": 15.1, "rate": 89.9}, targets) == {"latency": False, "rate": False}


def test_a_field_not_measured_is_never_met() -> None:
    targets = {"latency": (AT_MOST, 15.0), "rate": (AT_LEAST, 90.0)}
    assert judge({"latency": None}, targets) == {"latency": None, "rate": None}
    assert judge({"latency": True, "rate": "fast"}, targets) == {"latency": None, "rate": None}

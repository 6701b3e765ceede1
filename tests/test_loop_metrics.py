"""loop_metrics' families expose what prometheus_client's own Counter and Histogram would,
given the same observations (the text format, less prometheus_client's `_created` series)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from clef_frontend.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.1, 1.0, 2.5, 64.0)


def _text(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


@given(st.lists(st.tuples(st.sampled_from(["interactive", "bulk"]),
                          st.one_of(st.sampled_from([0.0, *BUCKETS]),
                                    st.floats(0, 500, allow_nan=False))), max_size=40))
def test_a_histogram_exposes_what_prometheus_clients_would(
        observations: list[tuple[str, float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("h_seconds", "help", ["class"], buckets=BUCKETS, registry=theirs)
    mine = LoopHistogram("h_seconds", "help", ["class"], buckets=BUCKETS)
    ours.register(mine)
    for name in ("interactive", "bulk"):  # children made up front, as metrics.py does
        reference.labels(name)
        mine.labels(name)
    for name, value in observations:
        reference.labels(name).observe(value)
        mine.labels(name).observe(value)
    assert _text(ours) == _text(theirs)


@given(st.lists(st.sampled_from([("/a", "200"), ("/a", "404"), ("/b", "200")]), max_size=20))
def test_a_counter_exposes_what_prometheus_clients_would(calls: list[tuple[str, str]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("requests", "help", ["route", "status"], registry=theirs)
    mine = LoopCounter("requests", "help", ["route", "status"])
    ours.register(mine)
    for route, status in calls:
        reference.labels(route, status).inc()
        mine.labels(route, status).inc()
    assert _text(ours) == _text(theirs)


def test_families_without_labels_are_exported_before_any_observation() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    Histogram("idle_seconds", "help", buckets=BUCKETS, registry=theirs)
    Counter("idle", "help", registry=theirs)
    ours.register(LoopHistogram("idle_seconds", "help", buckets=BUCKETS))
    ours.register(LoopCounter("idle", "help"))
    assert _text(ours) == _text(theirs)


def test_wrong_label_counts_and_unsorted_buckets_are_refused() -> None:
    family = LoopCounter("c", "help", ["route"])
    with pytest.raises(ValueError, match="1 label values"):
        family.labels("a", "b")
    with pytest.raises(ValueError, match="has labels"):
        family.inc()
    with pytest.raises(ValueError, match="increasing"):
        LoopHistogram("h", "help", buckets=(1.0, 0.5))

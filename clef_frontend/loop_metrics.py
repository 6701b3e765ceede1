"""Counters and histograms recorded once per request on the event loop, cheaply.

prometheus_client's `Counter.inc` takes a lock, and `Histogram.observe` takes two and walks its
bucket bounds in Python, and the front records one counter and five histograms per scoring
request, thousands of times a second (docs/benchmarks.md, the zero-work section). These record
with a list index (`bisect` finds the bucket in C) and an addition, and reach the registry as
ordinary metric families through a custom collector (prometheus_client's documented way to
expose values it does not hold), so the exposition, names, labels and buckets are what
prometheus_client's own types would give.

Only the event loop's thread records; a scrape on the metrics port's thread copies each child's
counts in one step under the GIL, so a scrape never sees a bucket count fall. Its `_sum` may
miss an observation that is already in the counts, until the next scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class CounterChild:
    """One labelled series of a LoopCounter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    """One labelled series of a LoopHistogram: a count per bucket (not cumulative) and a sum."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf's own
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # bisect_left: the first bound >= amount, as `le` is inclusive.
        self.counts[bisect.bisect_left(self._bounds, amount)] += 1
        self.sum += amount


Child = TypeVar("Child", CounterChild, HistogramChild)


class _Family(Collector, Generic[Child]):
    """Children by label values (created on first use), collected as one metric family; a
    family without labels has its one child from the start (exported before any observation,
    as prometheus_client's are) and records into it directly."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 new_child: Callable[[], Child]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new_child: Callable[[], Child] = new_child
        self._children: dict[tuple[str, ...], Child] = {}
        self._only: Child | None = None if self.labelnames else self.labels()

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
            child = self._children[values] = self._new_child()
        return child

    def _unlabelled(self) -> Child:
        if self._only is None:
            raise ValueError(f"{self.name} has labels: record into a child (`labels(...)`)")
        return self._only

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_Family[CounterChild]):
    """A counter family; `name` without `_total`, as prometheus_client's Counter takes it."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames, CounterChild)

    def inc(self, amount: float = 1.0) -> None:
        """For a family without labels."""
        self._unlabelled().value += amount

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)
        yield family


class LoopHistogram(_Family[HistogramChild]):
    """A histogram family with fixed bucket bounds (+Inf is added, as prometheus_client does)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float]) -> None:
        bounds = [float(bound) for bound in buckets if not math.isinf(bound)]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: bucket bounds must be in increasing order")
        self._bounds = bounds
        super().__init__(name, documentation, labelnames, lambda: HistogramChild(bounds))

    def observe(self, amount: float) -> None:
        """For a family without labels."""
        self._unlabelled().observe(amount)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        names = [floatToGoString(bound) for bound in self._bounds] + ["+Inf"]
        for values, child in list(self._children.items()):
            counts, total = list(child.counts), child.sum  # copied at once: counts never fall
            cumulative, buckets = 0, []
            for name, count in zip(names, counts, strict=True):
                cumulative += count
                buckets.append((name, float(cumulative)))
            family.add_metric(list(values), buckets, total)
        yield family

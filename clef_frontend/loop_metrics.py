"""Counters and histograms recorded once per request on the event loop, cheaply.

prometheus_client's `Counter.inc` takes a lock, and `Histogram.observe` takes two and walks its
bucket bounds in Python: at thousands of requests a second, the front's one counter and five
histograms per scoring request cost more than its whole answer cache (an A/B of the zero-work
front, docs/benchmarks.md). These record with a list index (`bisect` finds the bucket in C) and
an addition, and reach the registry as ordinary metric families through a custom collector
(prometheus_client's documented way to expose values it does not hold), so the exposition,
names, labels and buckets are what prometheus_client's own types would give.

Only the event loop's thread records; a scrape on the metrics port's thread copies each child's
counts in one step under the GIL, so a scrape never sees a bucket count fall. Its `_sum` may
miss an observation that is already in the counts, until the next scrape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence

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


class _Family(Collector):
    """Children by label values (created on first use), collected as one metric family."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}

    def _child(self, values: tuple[str, ...]) -> object:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
            child = self._children[values] = self._new_child()
        return child

    def _new_child(self) -> object:
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_Family):
    """A counter family; `name` without `_total`, as prometheus_client's Counter takes it."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._only: CounterChild | None = None
        if not self.labelnames:  # exported from the start, as prometheus_client's are
            self._only = self.labels()

    def labels(self, *values: str) -> CounterChild:
        child = self._child(values)
        assert isinstance(child, CounterChild)
        return child

    def inc(self, amount: float = 1.0) -> None:
        """For a family without labels."""
        if self._only is None:
            raise ValueError(f"{self.name} has labels: inc a child (`labels(...)`)")
        self._only.value += amount

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            assert isinstance(child, CounterChild)
            family.add_metric(list(values), child.value)
        yield family


class LoopHistogram(_Family):
    """A histogram family with fixed bucket bounds (+Inf is added, as prometheus_client does)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(bound) for bound in buckets if not math.isinf(bound)]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: bucket bounds must be in increasing order")
        self._bounds = bounds
        self._only: HistogramChild | None = None
        if not self.labelnames:  # exported from the start, as prometheus_client's are
            self._only = self.labels()

    def labels(self, *values: str) -> HistogramChild:
        child = self._child(values)
        assert isinstance(child, HistogramChild)
        return child

    def observe(self, amount: float) -> None:
        """For a family without labels."""
        if self._only is None:
            raise ValueError(f"{self.name} has labels: observe a child (`labels(...)`)")
        self._only.observe(amount)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        names = [floatToGoString(bound) for bound in self._bounds] + ["+Inf"]
        for values, child in list(self._children.items()):
            assert isinstance(child, HistogramChild)
            counts, total = list(child.counts), child.sum  # copied at once: counts never fall
            cumulative, buckets = 0, []
            for name, count in zip(names, counts, strict=True):
                cumulative += count
                buckets.append((name, float(cumulative)))
            family.add_metric(list(values), buckets, total)
        yield family

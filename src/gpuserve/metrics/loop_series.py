"""Counters and histograms written by one thread without a lock, read at scrape time.

``prometheus_client``'s ``Counter`` and ``Histogram`` take a lock on every ``inc`` and
``observe`` (a histogram observation takes two: its bucket and its sum), about 0.7 µs and
1.5 µs here. A request's series cost four of those on the event loop, which is the server's
bottleneck on small models. Every per-request series of gpuserve is written by one thread
(the event loop: engine statistics are recorded there), so these keep plain numbers that
only that thread adds to, and render them as Prometheus families when scraped (from any
thread: each read of a number is atomic under the GIL; a sample one observation stale is
fine).

The exposition is the same as ``prometheus_client``'s: a counter ``NAME`` is sampled as
``NAME_total``; a histogram as ``NAME_bucket{le}`` (cumulative), ``NAME_count`` and
``NAME_sum``; children appear once created by :meth:`LoopCounter.labels` /
:meth:`LoopHistogram.labels`, and leave with :meth:`~_Family.remove` (the series of a version
that unloaded, or of a model that left the repository).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class CounterChild:
    """One label set of a :class:`LoopCounter`; ``value`` only grows."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (>= 0). Call from the writing thread only."""
        self.value += amount


class HistogramChild:
    """One label set of a :class:`LoopHistogram`: a count per bucket (not cumulative) and
    the sum of the observed values."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is >= it. Call from the writing
        thread only."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


Child = TypeVar("Child", CounterChild, HistogramChild)


class _Family(Collector, Generic[Child]):
    """The children of one family, by label values (created on first use)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        new_child: Callable[[], Child],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new_child: Callable[[], Child] = new_child
        self._children: dict[tuple[str, ...], Child] = {}

    def labels(self, *values: str) -> Child:
        """The child of one label set (created empty on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child

    def remove(self, *prefix: str) -> int:
        """Drop every child whose first label values are ``prefix`` (a model, or a model and
        a version) so they leave the exposition; returns how many went. Call from the
        writing thread only (a scrape reads a copy of the children)."""
        n = len(prefix)
        gone = [values for values in list(self._children) if values[:n] == prefix]
        for values in gone:
            self._children.pop(values, None)
        return len(gone)


class LoopCounter(_Family[CounterChild]):
    """A counter family with labels, registered in ``registry``.

    Args:
        name: The family name without ``_total``.
        documentation: Its help text.
        labelnames: The label names of every child.
        registry: Where it is scraped from.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        super().__init__(name, documentation, labelnames, CounterChild)
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        yield family


class LoopHistogram(_Family[HistogramChild]):
    """A histogram family with labels, registered in ``registry``.

    Args:
        name: The family name.
        documentation: Its help text.
        labelnames: The label names of every child.
        buckets: Upper bounds, increasing (``+Inf`` is added).
        registry: Where it is scraped from.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must increase, got {bounds}")
        super().__init__(name, documentation, labelnames, lambda: HistogramChild(bounds))
        self.bounds = bounds
        self._le = [floatToGoString(b) for b in bounds] + ["+Inf"]
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts = list(child.counts)  # one copy, so the buckets agree with the count
            cumulative: list[tuple[str, float]] = []
            total = 0
            for le, count in zip(self._le, counts, strict=True):
                total += count
                cumulative.append((le, float(total)))
            family.add_metric(list(values), cumulative, child.sum)
        yield family

"""Prometheus families declared as one table and read at scrape time: the shape of the services'
own scrape-time collectors (the proxy's live gauges, the controller's state).

A collector declares each family it exports once, as a :class:`Family` (name, help, kind, labels,
samples), in a tuple; :func:`families` turns the table into the families of one scrape. Adding a
metric is one row. ``samples`` reads the scrape's context (whatever the collector reads its values
from) and returns the family's samples, or ``None`` when the family is absent from this scrape (its
source is not running); an empty list still exports the family, with no sample.

Kernel: it knows ``prometheus_client`` and nothing of any service.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

C = TypeVar("C")
Sample = tuple[Sequence[str], float]  # label values (in the family's label order), value
Samples = Iterable[Sample] | None

_KINDS: dict[str, type[GaugeMetricFamily] | type[CounterMetricFamily]] = {
    "gauge": GaugeMetricFamily,
    "counter": CounterMetricFamily,
}


@dataclass(frozen=True)
class Family(Generic[C]):
    """One exported family: ``labels`` are its label names, or a function of the scrape's context where
    they depend on it (an alert's own labels); ``samples`` reads its samples from the context."""

    name: str
    help: str
    kind: Literal["gauge", "counter"]
    labels: Sequence[str] | Callable[[C], Sequence[str]]
    samples: Callable[[C], Samples]


def one(value: float) -> list[Sample]:
    """The one sample of a family without labels."""
    return [((), value)]


def by_key(values: Iterable[tuple[str, float]]) -> list[Sample]:
    """One sample per key (its one label), sorted by key, as floats."""
    return [((key,), float(n)) for key, n in sorted(values)]


def families(table: Iterable[Family[C]], ctx: C) -> Iterator[Metric]:
    """The families of one scrape, in the table's order; those whose samples are ``None`` left out.
    Raises what a ``samples`` function raises (prometheus_client then fails the scrape)."""
    for fam in table:
        samples = fam.samples(ctx)
        if samples is None:
            continue
        labels = fam.labels(ctx) if callable(fam.labels) else fam.labels
        metric = _KINDS[fam.kind](fam.name, fam.help, labels=list(labels))
        for values, value in samples:
            metric.add_metric(list(values), value)
        yield metric

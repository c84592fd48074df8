"""How a parsed page becomes one snapshot's values.

What is kept is ``store.families.SPECS``, the one table of the stored vLLM families and
the ``store.models.Snapshot`` column(s) each fills. Values are summed over the ``engine``
label (data-parallel engines), except ``mean`` families (``kv_cache_usage``). Histograms
keep their sum and count in columns and their cumulative buckets in
``Snapshot.histograms``. Any other ``vllm:nixl_*`` series (a newer vLLM) is summed into
``extra``.

``from_page`` is the reference extraction over the general parser's output; the hot
path (``collector.fastparse``) must produce the same ``Signals`` for the same text. This
module does no I/O and knows nothing about the store's session or the scraper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from collector.parse import Family, ParsedPage, parse_text
from pdscope.kvcompat import MALFORMED, Identity, identity, kept
from store.families import (
    ALIASES,
    CACHE_CONFIG,
    ENGINE_FAMILY,
    NIXL_PREFIX,
    PROCESS_START,
    SPEC_BY_FAMILY,
    SPECS,
    Spec,
)

# Columns averaged over engines rather than summed (a fraction per engine).
_MEAN_COLUMNS = frozenset(c for s in SPECS if s.mean for c in s.stored_columns)


@dataclass
class Signals:
    """What one page yields for one snapshot row. ``values`` maps Snapshot columns to floats."""

    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    engines: int | None = None
    process_start_ts: float | None = None
    errors: list[str] = field(default_factory=list)
    # what the instance reports of the fields a P x D pair must agree on (pdscope.kvcompat)
    identity: Identity = ()


def _one(values: set[str]) -> str:
    """The one value every engine reports, or :data:`MALFORMED` where they disagree."""
    return kept(next(iter(values))) if len(values) == 1 else MALFORMED


def identity_of(cache: Family | None, engine: Family | None) -> Identity:
    """The identity (:mod:`pdscope.kvcompat`) a page reports: ``block_size`` and ``cache_dtype`` from the
    ``vllm:cache_config_info`` family ``cache``, ``model`` from the ``model_name`` label of ``engine``
    (:data:`store.families.ENGINE_FAMILY`); a field missing from the page is left out."""
    found: dict[str, set[str]] = {}
    for s in cache.samples if cache is not None else ():
        for label in ("block_size", "cache_dtype"):
            if label in s.labels:
                found.setdefault(label, set()).add(s.labels[label])
    for s in engine.samples if engine is not None else ():
        if "model_name" in s.labels and not s.name.endswith("_created"):
            found.setdefault("model", set()).add(s.labels["model_name"])
    return identity({f: _one(v) for f, v in found.items()})


def openmetrics_name(family: str, mtype: str) -> str:
    """The 0.0.4 name of a family: OpenMetrics names a counter ``foo``, its samples ``foo_total``."""
    if mtype == "counter" and not family.endswith("_total"):
        return family + "_total"
    return family


class HistogramAcc:
    """Cumulative buckets summed over engines; ``result`` gives the JSON-safe shape."""

    __slots__ = ("buckets", "count", "inf", "sum")

    def __init__(self) -> None:
        self.buckets: dict[float, float] = {}
        self.inf: float | None = None
        self.sum: float | None = None
        self.count: float | None = None

    def add_bucket(self, le: float, value: float) -> None:
        if le == math.inf:
            self.inf = value if self.inf is None else self.inf + value
        else:
            self.buckets[le] = self.buckets.get(le, 0.0) + value

    def add_sum(self, value: float) -> None:
        self.sum = value if self.sum is None else self.sum + value

    def add_count(self, value: float) -> None:
        self.count = value if self.count is None else self.count + value

    def result(self, family: str, errors: list[str]) -> dict[str, Any] | None:
        bounds = sorted(self.buckets)
        counts = [self.buckets[b] for b in bounds]
        inf = self.inf if self.inf is not None else self.count
        if inf is None:
            return None
        counts.append(inf)
        numbers = [*bounds, *counts, self.sum if self.sum is not None else 0.0]
        if not math.isfinite(sum(numbers)):  # one NaN or Inf makes the sum non-finite
            errors.append(f"{family}: non-finite bucket, sum or count; histogram dropped")
            return None
        return {
            "le": bounds,
            "counts": counts,
            "sum": self.sum or 0.0,
            "count": self.count if self.count is not None else inf,
        }


def finish(
    signals: Signals,
    scalars: dict[str, list[float]],
    hists: dict[str, HistogramAcc],
) -> Signals:
    """Fold per-engine values into columns; shared by both extraction paths."""
    for spec_family, acc in hists.items():
        spec = SPEC_BY_FAMILY.get(spec_family)
        shape = acc.result(spec_family, signals.errors)
        if shape is None:
            continue
        if spec is None:  # an unknown nixl histogram
            signals.extra[spec_family + "_sum"] = shape["sum"]
            signals.extra[spec_family + "_count"] = shape["count"]
            continue
        if spec.column:
            signals.values[spec.column + "_sum"] = shape["sum"]
            signals.values[spec.column + "_count"] = shape["count"]
        if spec.buckets:
            signals.histograms[spec_family] = shape
    for column, vals in scalars.items():
        if not math.isfinite(sum(vals)):
            signals.errors.append(f"{column}: non-finite value; not stored")
            continue
        if column.startswith(NIXL_PREFIX):
            signals.extra[column] = sum(vals)
        elif column in _MEAN_COLUMNS:
            signals.values[column] = sum(vals) / len(vals)
        else:
            signals.values[column] = sum(vals)
    return signals


def from_page(page: ParsedPage) -> Signals:
    """Extract the stored signals from a fully parsed page (the reference path)."""
    signals = Signals(errors=list(page.errors))
    scalars: dict[str, list[float]] = {}
    hists: dict[str, HistogramAcc] = {}
    present = {openmetrics_name(name, fam.type) for name, fam in page.families.items()}
    engines: set[str] = set()
    for name, fam in page.families.items():
        family = openmetrics_name(name, fam.type)
        if family in ALIASES and ALIASES[family] not in present:
            family = ALIASES[family]
        spec = SPEC_BY_FAMILY.get(family)
        if family == PROCESS_START and fam.samples:
            signals.process_start_ts = fam.samples[0].value
            continue
        if spec is None:
            if family.startswith(NIXL_PREFIX) and not family.endswith("_created"):
                spec = Spec(family, "histogram" if fam.type == "histogram" else "scalar", column=family)
            else:
                continue
        if family == ENGINE_FAMILY:
            engines.update(s.labels.get("engine", "") for s in fam.samples)
        columns = dict(spec.columns)
        for s in fam.samples:
            if spec.kind == "scalar":
                if s.name.endswith("_created"):
                    continue
                scalars.setdefault(spec.column or family, []).append(s.value)
            elif spec.kind == "labelled":
                if s.name.endswith("_created"):
                    continue
                col = columns.get(s.labels.get(spec.label or "", ""))
                if col is not None:
                    scalars.setdefault(col, []).append(s.value)
            else:
                acc = hists.setdefault(family, HistogramAcc())
                if s.name.endswith("_bucket"):
                    try:
                        acc.add_bucket(float(s.labels.get("le", "")), s.value)
                    except ValueError:
                        signals.errors.append(f"{family}: bad le {s.labels.get('le')!r}")
                elif s.name.endswith("_sum"):
                    acc.add_sum(s.value)
                elif s.name.endswith("_count"):
                    acc.add_count(s.value)
    if engines:
        signals.engines = len(engines)
    signals.identity = identity_of(page.families.get(CACHE_CONFIG), page.families.get(ENGINE_FAMILY))
    return finish(signals, scalars, hists)


def from_text(text: str | bytes) -> Signals:
    return from_page(parse_text(text))

"""The scrape hot path: read only the families pdscope stores, straight into ``Signals``.

A vLLM page is ~60 KiB and ~730 lines, of which pdscope keeps about half; the general
parser (``collector.parse``) tokenises every line and builds a label dict for every
sample, which is where its time goes. This scanner jumps from ``# TYPE`` line to
``# TYPE`` line with ``str.find``, skips families not in ``store.families.SPECS``
without looking at their lines, and in a kept family reads only the one label that
matters (``le``, ``finished_reason``, ``stage``...) and the value.

It relies on what every Prometheus client emits: a family's samples follow its
``# TYPE`` line together. Pages it cannot handle that way (no ``# TYPE`` lines at all)
go to the general parser, so the result is the same either way; the tests hold the two
paths to the same output on the real captures and on variants. A series that appears
twice on a page (same name, same labels in any order) is kept once, the first, and the
repeat is reported in ``Signals.errors``, as Prometheus does; it is never summed (which
would double a counter and fake a reset on the next page). It never raises.
"""

from __future__ import annotations

import math
import re

from collector.parse import decode_page, parse_text
from collector.signals import HistogramAcc, Signals, finish, from_text, identity_of, openmetrics_name
from pdscope.kvcompat import Identity
from store.families import (
    ALIASES,
    CACHE_CONFIG,
    ENGINE_FAMILY,
    NIXL_PREFIX,
    PROCESS_START,
    SPEC_BY_FAMILY,
    Spec,
)

__all__ = ["extract_signals"]

_TYPE = "# TYPE "


def _label(line: str, key: str) -> str | None:
    """The raw value of label ``key`` (``key`` given as ``name="``) in a sample line."""
    start = line.find(key)
    while start > 0 and line[start - 1] not in "{,":
        start = line.find(key, start + 1)
    if start <= 0:
        return None
    start += len(key)
    end = line.find('"', start)
    return line[start:end] if end >= 0 else None


def extract_signals(data: str | bytes) -> Signals:
    """Signals from one page. Never raises; problems land in ``Signals.errors``."""
    text, decode_error = decode_page(data)
    if _TYPE not in text:
        return from_text(text)
    signals = Signals()
    if decode_error:
        signals.errors.append(decode_error)
    scalars: dict[str, list[float]] = {}
    hists: dict[str, HistogramAcc] = {}
    engines: set[str] = set()
    blocks = _kept_blocks(text)
    present = {b[0] for b in blocks}
    for family, mtype, start, end in blocks:
        if family == CACHE_CONFIG:
            continue  # labels only: read by _identity
        if family in ALIASES:
            if ALIASES[family] in present:
                continue
            family = ALIASES[family]
        local: dict[str, list[float]] = {}
        try:
            _block(family, mtype, text, start, end, local, hists, engines, signals)
        except (ValueError, IndexError) as exc:
            signals.errors.append(f"{family}: malformed sample ({exc}); family skipped")
            hists.pop(family, None)
            continue
        for column, vals in local.items():
            scalars.setdefault(column, []).extend(vals)
    if engines:
        signals.engines = len(engines)
    signals.identity = _identity(text, blocks)
    return finish(signals, scalars, hists)


def _identity(text: str, blocks: list[tuple[str, str, int, int]]) -> Identity:
    """The identity the page reports, read by the general parser from the two small blocks that carry it
    (one line per engine each), so that both paths agree on escaped label values."""
    families = {}
    for family, mtype, start, end in blocks:
        if family in (CACHE_CONFIG, ENGINE_FAMILY) and family not in families:
            families[family] = parse_text(f"{_TYPE}{family} {mtype}\n{text[start:end]}").families.get(family)
    return identity_of(families.get(CACHE_CONFIG), families.get(ENGINE_FAMILY))


def _kept_blocks(text: str) -> list[tuple[str, str, int, int]]:
    """The blocks of the families pdscope keeps, as (normalised family name, type, start, end) of their
    sample lines, in page order; aliases are resolved by the caller once all names are known."""
    blocks: list[tuple[str, str, int, int]] = []
    pos = text.find(_TYPE)
    if pos > 0 and text[pos - 1] != "\n":
        pos = text.find("\n" + _TYPE) + 1 or -1
    while pos >= 0:
        eol = text.find("\n", pos)
        if eol < 0:
            eol = len(text)
        header = text[pos + len(_TYPE) : eol].split()
        nxt = text.find("\n" + _TYPE, eol)
        end = len(text) if nxt < 0 else nxt
        if len(header) == 2:
            family = openmetrics_name(header[0], header[1])
            if (
                family in SPEC_BY_FAMILY
                or family in ALIASES
                or family in (PROCESS_START, CACHE_CONFIG)
                or (family.startswith(NIXL_PREFIX) and not family.endswith("_created"))
            ):
                blocks.append((family, header[1], eol + 1, end))
        pos = -1 if nxt < 0 else nxt + 1
    return blocks


def _series_key(name: str, labels: str) -> tuple[str, str | tuple[str, ...]]:
    """A key equal for the same series however its labels are ordered or spaced."""
    inner = labels.strip()[1:-1] if labels else ""
    if "," not in inner:
        return name, inner.strip().rstrip('"')
    parts = (p.strip().rstrip('"') for p in inner.split('",'))
    return name, tuple(sorted(p for p in parts if p))


def _first_of_each(
    rows: list[tuple[str, str, str]], family: str, signals: Signals
) -> list[tuple[str, str, str]]:
    """The rows with each series' first sample only; each repeat reported."""
    seen: set[tuple[str, str | tuple[str, ...]]] = set()
    out: list[tuple[str, str, str]] = []
    for row in rows:
        key = _series_key(row[0], row[1])
        if key in seen:
            signals.errors.append(f"{family}: duplicate series {row[0]}{row[1]}: kept the first")
            continue
        seen.add(key)
        out.append(row)
    return out


_HIST_RE = re.compile(r"^([^\s{#]*_(bucket|sum|count))(\{[^\n]*\})?[ \t]+([^\s#]+)", re.M)
_SAMPLE_RE = re.compile(r"^([^\s{#]+)(\{[^\n]*\})?[ \t]+([^\s#]+)", re.M)
_ENGINE_RE = re.compile(r'[{,]engine="([^"]*)"')


def _block(
    family: str,
    mtype: str,
    text: str,
    start: int,
    end: int,
    scalars: dict[str, list[float]],
    hists: dict[str, HistogramAcc],
    engines: set[str],
    signals: Signals,
) -> None:
    spec = SPEC_BY_FAMILY.get(family)
    if family == PROCESS_START:
        m = _SAMPLE_RE.search(text, start, end)
        if m is not None:
            signals.process_start_ts = float(m.group(3))
        return
    if spec is None:  # any other vllm:nixl_* family
        spec = Spec(family, "histogram" if mtype == "histogram" else "scalar", column=family)
    if spec.kind == "histogram":
        _histogram_block(family, text, start, end, hists.setdefault(family, HistogramAcc()), signals)
        return
    samples = _first_of_each(
        [
            (name, labels, value)
            for name, labels, value in _SAMPLE_RE.findall(text, start, end)
            if not name.endswith("_created")
        ],
        family,
        signals,
    )
    if spec.kind == "labelled":
        key = f'{spec.label}="'
        columns = dict(spec.columns)
        for _name, labels, value in samples:
            col = columns.get(_label(labels, key) or "")
            if col is not None:
                scalars.setdefault(col, []).append(float(value))
        return
    scalars.setdefault(spec.column or family, []).extend(float(v) for _, _, v in samples)
    if family == ENGINE_FAMILY:
        for _name, labels, _value in samples:
            m = _ENGINE_RE.search(labels)
            engines.add(m.group(1) if m else "")


def _histogram_block(
    family: str, text: str, start: int, end: int, acc: HistogramAcc, signals: Signals
) -> None:
    """A histogram family's samples into ``acc`` (the same family's other blocks add to it)."""
    buckets = acc.buckets
    rows = [(name, labels, value) for name, _kind, labels, value in _HIST_RE.findall(text, start, end)]
    for name, labels, value in _first_of_each(rows, family, signals):
        kind = name[name.rfind("_") + 1 :]
        if kind == "bucket":
            i = labels.find('le="')
            while i > 0 and labels[i - 1] not in "{,":
                i = labels.find('le="', i + 1)
            if i < 0:
                raise ValueError("bucket without le")
            le = float(labels[i + 4 : labels.index('"', i + 4)])
            if le == math.inf:
                acc.add_bucket(le, float(value))
            else:
                buckets[le] = buckets.get(le, 0.0) + float(value)
        elif kind == "sum":
            acc.add_sum(float(value))
        else:
            acc.add_count(float(value))

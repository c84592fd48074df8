"""Prometheus text exposition (0.0.4, plus the OpenMetrics basics) into typed families.

This is the general parser: every family, every sample, every label. It never raises on
bad input; a malformed line is skipped and described in ``ParsedPage.errors`` (with its
line number), so one odd line from one instance cannot cost the whole scrape. The
collector's hot path does not use it (see ``collector.fastpath``, which reads only the
signals pdscope stores); tests use it as the reference the hot path must agree with.

What it tolerates, because real exporters do it:

- ``_total``/``_created`` (and ``_bucket``/``_count``/``_sum``) samples: a sample joins the
  family its ``# TYPE`` line names; when no family of its own name was declared, the
  suffix is stripped to find the counter, histogram or summary it belongs to (OpenMetrics
  names a counter ``foo`` and its samples ``foo_total``; the 0.0.4 text from
  prometheus_client names it ``foo_total`` and puts ``foo_created`` in a gauge family).
- missing ``# HELP``/``# TYPE`` (the family is ``untyped``), the multiprocess HELP text
  ``Multiprocess metric``, a family whose samples are split by another family's,
- ``NaN``, ``+Inf``, ``-Inf``, timestamps, OpenMetrics exemplars and ``# EOF``,
- escapes in label values (``\\\\``, ``\\"``, ``\\n``) and in HELP text,
- non-UTF-8 bytes (decoded with replacement characters, reported once),
- duplicate series (the first is kept, each repeat reported).

It must not do I/O, log, or know which metrics pdscope cares about.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Family", "ParsedPage", "Sample", "parse_float", "parse_text"]

MAX_ERRORS = 100  # a garbage page reports this many lines, then a count

_TYPES = frozenset(
    {"counter", "gauge", "histogram", "summary", "untyped", "unknown", "gaugehistogram", "info", "stateset"}
)
# Which suffixed sample names may belong to a family of each type.
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("_count", "_sum", "_created"),
    "info": ("_info",),
}
_ALL_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum", "_gcount", "_gsum", "_info")

_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LV = r'[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"(?:[^"\\\n]|\\.)*"'
_SAMPLE_RE = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*"
    r"(?:\{(\s*(?:" + _LV + r"\s*,\s*)*(?:" + _LV + r"\s*)?)\})?"
    r"[ \t]+(\S+)(?:[ \t]+(\S+))?[ \t]*(?:#.*)?\Z"
)
_PAIR_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\\n]|\\.)*)"')
_NAME_START_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:[ \t{]|\Z)")
_ESCAPE_RE = re.compile(r"\\(.)")
_LABEL_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_SPECIAL_FLOATS = {
    "NaN": math.nan,
    "nan": math.nan,
    "+Inf": math.inf,
    "Inf": math.inf,
    "inf": math.inf,
    "+inf": math.inf,
    "-Inf": -math.inf,
    "-inf": -math.inf,
}


class Sample(NamedTuple):
    """One series value: the full sample name (e.g. ``foo_bucket``), its labels and value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Family:
    """A metric family as its ``# TYPE`` line names it; ``type`` is ``untyped`` if none."""

    name: str
    type: str
    help: str
    samples: tuple[Sample, ...]


@dataclass(frozen=True)
class ParsedPage:
    """Every family on the page, by name, and one line per malformed input."""

    families: dict[str, Family]
    errors: list[str]


class _Builder:
    __slots__ = ("help", "name", "samples", "seen", "type")

    def __init__(self, name: str) -> None:
        self.name = name
        self.type = "untyped"
        self.help = ""
        self.samples: list[Sample] = []
        self.seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()


def parse_float(text: str) -> float:
    """A Prometheus sample value (Go's ParseFloat forms, ``NaN``, ``+Inf``). Raises ValueError."""
    special = _SPECIAL_FLOATS.get(text)
    if special is not None:
        return special
    if "_" in text:  # Python accepts 1_000, Prometheus does not
        raise ValueError(text)
    return float(text)


def _unescape_label(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPE_RE.sub(lambda m: _LABEL_ESCAPES.get(m.group(1), "\\" + m.group(1)), value)


def _unescape_help(text: str) -> str:
    if "\\" not in text:
        return text
    return _ESCAPE_RE.sub(lambda m: {"\\": "\\", "n": "\n"}.get(m.group(1), "\\" + m.group(1)), text)


def _split_sample(line: str) -> Sample:
    """``name{labels} value [timestamp] [# exemplar]``; raises ValueError."""
    m = _SAMPLE_RE.match(line)
    if m is None:
        raise ValueError(_diagnose(line))
    name, label_text, value_text, ts_text = m.groups()
    labels: dict[str, str] = {}
    if label_text:
        pairs = _PAIR_RE.findall(label_text)
        for key, raw in pairs:
            labels[key] = _unescape_label(raw) if "\\" in raw else raw
        if len(labels) != len(pairs):
            raise ValueError("a label name is repeated")
    value = parse_float(value_text)
    if ts_text is not None:
        parse_float(ts_text)  # a timestamp: validated, then dropped
    return Sample(name, labels, value)


def _diagnose(line: str) -> str:
    if not _NAME_START_RE.match(line):
        return "invalid metric name"
    brace = line.find("{")
    if brace >= 0 and "}" not in line[brace:]:
        return "unclosed label set"
    if brace >= 0:
        return "bad label set or value"
    return "bad value"


def decode_page(data: str | bytes) -> tuple[str, str | None]:
    """Text of a page and, if it was not valid UTF-8, a description of the problem."""
    if isinstance(data, str):
        return data, None
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        return data.decode(
            "utf-8", errors="replace"
        ), f"not valid UTF-8 at byte {exc.start}: decoded with replacement"


def _family_for(name: str, builders: dict[str, _Builder]) -> _Builder | None:
    b = builders.get(name)
    if b is not None:
        return b
    for suffix in _ALL_SUFFIXES:
        if name.endswith(suffix):
            base = builders.get(name[: -len(suffix)])
            if base is not None and suffix in _SUFFIXES.get(base.type, ()):
                return base
    return None


def parse_text(text: str | bytes) -> ParsedPage:
    """Parse a whole exposition page. Never raises; see ``ParsedPage.errors``."""
    page, decode_error = decode_page(text)
    errors: list[str] = []
    dropped = 0

    def err(lineno: int, msg: str) -> None:
        nonlocal dropped
        if len(errors) < MAX_ERRORS:
            errors.append(f"line {lineno}: {msg}")
        else:
            dropped += 1

    if decode_error is not None:
        errors.append(decode_error)
    builders: dict[str, _Builder] = {}
    # Only "\n" ends a line (str.splitlines would also split on \x1c-\x1e, \x85, \u2028, which
    # are legal inside label values).
    for lineno, raw in enumerate(page.split("\n"), start=1):
        line = raw.strip(" \t\r")
        if not line:
            continue
        if line[0] == "#":
            _meta_line(line, lineno, builders, err)
            continue
        try:
            sample = _split_sample(line)
        except ValueError as exc:
            err(lineno, f"malformed sample ({exc}): {line[:80]!r}")
            continue
        b = _family_for(sample.name, builders)
        if b is None:
            b = builders[sample.name] = _Builder(sample.name)
        key = (sample.name, tuple(sorted(sample.labels.items())))
        if key in b.seen:
            err(lineno, f"duplicate series {sample.name}{sample.labels}: kept the first")
            continue
        b.seen.add(key)
        b.samples.append(sample)
    if dropped:
        errors.append(f"... and {dropped} more malformed lines")
    families = {name: Family(b.name, b.type, b.help, tuple(b.samples)) for name, b in builders.items()}
    return ParsedPage(families, errors)


def _meta_line(
    line: str, lineno: int, builders: dict[str, _Builder], report: Callable[[int, str], None]
) -> None:
    parts = line[1:].strip().split(None, 2)
    if not parts:
        return
    kind = parts[0]
    if kind == "EOF":
        return
    if kind not in ("HELP", "TYPE", "UNIT"):
        return  # an ordinary comment
    if len(parts) < 2:
        report(lineno, f"# {kind} without a metric name")
        return
    name = parts[1]
    if not _NAME_RE.match(name):
        report(lineno, f"# {kind} with an invalid metric name {name[:60]!r}")
        return
    rest = parts[2] if len(parts) > 2 else ""
    b = builders.get(name)
    if kind == "TYPE":
        mtype = rest.strip().lower()
        if mtype not in _TYPES:
            report(lineno, f"# TYPE {name} has unknown type {rest[:30]!r}; treated as untyped")
            mtype = "untyped"
        if b is None:
            b = builders[name] = _Builder(name)
        elif b.samples:
            report(lineno, f"# TYPE {name} after its samples; type ignored")
            return
        elif b.type != "untyped" and b.type != mtype:
            report(lineno, f"# TYPE {name} declared twice ({b.type}, {mtype}); kept the first")
            return
        b.type = mtype
    elif kind == "HELP":
        if b is None:
            b = builders[name] = _Builder(name)
        b.help = _unescape_help(rest)

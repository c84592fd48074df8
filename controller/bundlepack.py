"""An incident bundle's contents, bounded: its name, its tables as JSON lines, its manifest.

Pure (no I/O, no clock): :mod:`controller.bundle` reads the store and writes the archive, this
module decides what goes in it. A bundle holds, under one folder named like the archive::

    manifest.json      what is inside, the window, the trigger, every limit that cut something
    report.html        the self-contained report (controller.bundlereport)
    attribution.json   GET /v1/slo/attribution's JSON for the window
    settings.json      the Settings in force (passwords in URLs masked)
    policy_configs.json  the stored policy configs the window's decisions ran under
    alerts.jsonl  decisions.jsonl  overrides.jsonl  records.jsonl  snapshots.jsonl

Two bounds. ``max_records``: a table with more rows in the window is read every k-th row (the
store's ids modulo k), so the sample still spans the window. ``max_bytes``: the content, JSON
as written, fits in it; the small members go first and the tables share the rest, the tables
with fewer rows first, each keeping its newest rows that fit its share (an incident's last
minutes matter most) and handing what it does not use to the next. Either cut is a note in the
manifest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

from pdscope.jsonsafe import plain

FORMAT: Final = "pdscope-bundle"
FORMAT_VERSION: Final = 1
SUFFIX: Final = ".tar.gz"
TABLES: Final = ("alerts", "decisions", "overrides", "records", "snapshots")
# the members a bundle always has, besides the tables' .jsonl
FIXED: Final = ("manifest.json", "report.html", "attribution.json", "settings.json", "policy_configs.json")
MANIFEST_RESERVE: Final = 64 * 1024  # bytes kept for the manifest, written last
NOTES_RESERVE: Final = 16 * 1024  # bytes kept for the report's notes on what was cut, known last
NAME_RE: Final = re.compile(r"^pdscope-[A-Za-z0-9._-]{1,200}\.tar\.gz$")
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")


class BundleTooLarge(ValueError):
    """The fixed members alone do not fit in ``max_bytes``."""


def stamp(ts: float) -> str:
    """``20261202T031500Z``: a file-name-safe UTC time, to the second."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y%m%dT%H%M%SZ")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _part(text: str) -> str:
    return _UNSAFE.sub("_", text).strip("._-")[:64] or "x"


def alert_bundle_name(rule: str, labels: Mapping[str, str], fired_at: float) -> str:
    """``pdscope-<alertname>-<instance or pool or fleet>-<UTC time>.tar.gz``."""
    where = labels.get("instance") or labels.get("pool") or "fleet"
    return f"pdscope-{_part(rule)}-{_part(where)}-{stamp(fired_at)}{SUFFIX}"


def range_bundle_name(lo: float, hi: float) -> str:
    """A bundle asked for by range (``pdscope bundle``): ``pdscope-range-<from>-<until>.tar.gz``."""
    return f"pdscope-range-{stamp(lo)}-{stamp(hi)}{SUFFIX}"


def is_bundle_name(name: str) -> bool:
    """A name this module makes: no folder, no dot-file (temporary files start with a dot)."""
    return NAME_RE.match(name) is not None and ".." not in name


def folder_of(name: str) -> str:
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name


def dumps(value: Any, *, indent: int | None = None) -> bytes:
    return json.dumps(plain(value), sort_keys=True, indent=indent, allow_nan=False).encode()


def _mask_url(text: str) -> str:
    try:
        parts = urlsplit(text)
    except ValueError:
        return text
    if not parts.scheme or parts.password is None:
        return text
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit(parts._replace(netloc=f"{user}{host}{port}"))


def redact(value: Any) -> Any:
    """The settings' JSON with every password inside a URL masked (a store URL may carry one)."""
    if isinstance(value, str):
        return _mask_url(value) if "://" in value and "@" in value else value
    if isinstance(value, Mapping):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def _sample_note(name: str, total: int, every: int, read: int) -> list[str]:
    if every == 1:
        return []
    return [
        f"{name}: {total} rows in the window, over max_records: 1 row in every {every} was kept ({read} rows)"
    ]


@dataclass(frozen=True)
class TableRead:
    """One table's rows of the window as read: ``total`` in the store, every ``every``-th one read."""

    name: str
    rows: Sequence[Mapping[str, Any]]
    total: int
    every: int = 1

    def sample_note(self) -> list[str]:
        return _sample_note(self.name, self.total, self.every, len(self.rows))


@dataclass(frozen=True)
class TablePacked:
    name: str
    data: bytes
    total: int
    read: int
    included: int
    every: int
    byte_cut: bool

    def entry(self) -> dict[str, Any]:
        return {
            "member": f"{self.name}.jsonl",
            "rows_in_window": self.total,
            "rows_read": self.read,
            "rows_included": self.included,
            "sampled_every": self.every,
            "cut_to_fit_bytes": self.byte_cut,
        }

    def notes(self) -> list[str]:
        out = _sample_note(self.name, self.total, self.every, self.read)
        if self.byte_cut:
            out.append(
                f"{self.name}: cut to fit max_bytes: the newest {self.included} of {self.read} rows kept"
            )
        return out


def pack_table(t: TableRead, budget: int) -> TablePacked:
    """The newest rows of ``t`` whose JSON lines fit in ``budget`` bytes, oldest first."""
    lines: list[bytes] = []
    used = 0
    for row in reversed(t.rows):
        line = dumps(row) + b"\n"
        if used + len(line) > budget:
            break
        lines.append(line)
        used += len(line)
    lines.reverse()
    return TablePacked(
        t.name, b"".join(lines), t.total, len(t.rows), len(lines), t.every, len(lines) < len(t.rows)
    )


def pack_tables(tables: Sequence[TableRead], budget: int) -> list[TablePacked]:
    """Share ``budget`` among ``tables``: the tables with fewer rows first, each taking at most an even
    share of what is left, so a small table is whole and a large one gets what the others leave."""
    order = sorted(tables, key=lambda t: (len(t.rows), t.name))
    left = max(0, budget)
    out: dict[str, TablePacked] = {}
    for k, t in enumerate(order):
        share = left // (len(order) - k)
        p = pack_table(t, share)
        out[t.name] = p
        left -= len(p.data)
    return [out[t.name] for t in tables]


@dataclass(frozen=True)
class Trigger:
    """The alert a bundle was written for."""

    rule: str
    fingerprint: str
    labels: Mapping[str, str]
    severity: str
    description: str
    value: float
    active_since: float
    fired_at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "alertname": self.rule,
            "fingerprint": self.fingerprint,
            "labels": dict(self.labels),
            "severity": self.severity,
            "description": self.description,
            "value": self.value,
            "active_since": self.active_since,
            "fired_at": self.fired_at,
            "fired_at_iso": iso(self.fired_at),
        }


@dataclass(frozen=True)
class Contents:
    """Everything a bundle holds, before packing."""

    name: str
    lo: float
    hi: float
    created_at: float
    trigger: Trigger | None
    tables: Sequence[TableRead]
    report: Callable[[Sequence[str]], str]  # the report's HTML, given the notes on what was cut
    attribution: Mapping[str, Any]
    settings: Mapping[str, Any] | None
    policy_configs: Sequence[Mapping[str, Any]]
    max_records: int
    max_bytes: int
    notes: Sequence[str] = field(default=())
    version: str = ""


def manifest(
    c: Contents, packed: Sequence[TablePacked], sizes: Mapping[str, int], notes: Sequence[str]
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "pdscope_version": c.version,
        "name": c.name,
        "created_at": c.created_at,
        "created_at_iso": iso(c.created_at),
        "window": {"from": c.lo, "until": c.hi, "from_iso": iso(c.lo), "until_iso": iso(c.hi)},
        "reason": "alert" if c.trigger is not None else "range",
        "trigger": None if c.trigger is None else c.trigger.as_dict(),
        "limits": {"max_records": c.max_records, "max_bytes": c.max_bytes},
        "tables": {p.name: p.entry() for p in packed},
        "members": [{"name": n, "bytes": b} for n, b in sizes.items()],
        "policy_configs": [str(p.get("fingerprint")) for p in c.policy_configs],
        "settings_included": c.settings is not None,
        "truncated": any(p.every > 1 or p.byte_cut for p in packed),
        "notes": list(notes),
    }


def pack(c: Contents) -> list[tuple[str, bytes]]:
    """The archive's members (path inside it, bytes), every one under the bundle's folder; the
    content is at most ``c.max_bytes``. The report is drawn twice: once to size it, then with the
    notes on what the tables lost. Raises :class:`BundleTooLarge` when the members other than the
    tables alone do not fit."""
    fixed: dict[str, bytes] = {
        "attribution.json": dumps(c.attribution, indent=1),
        "settings.json": dumps(c.settings, indent=1),
        "policy_configs.json": dumps(list(c.policy_configs), indent=1),
    }
    sampled = [n for t in c.tables for n in t.sample_note()]
    report_reserve = len(c.report([*c.notes, *sampled]).encode()) + NOTES_RESERVE
    used = sum(len(b) for b in fixed.values()) + report_reserve + MANIFEST_RESERVE
    if used > c.max_bytes:
        raise BundleTooLarge(
            f"max_bytes {c.max_bytes} is too small: the report, attribution and config alone take {used}"
        )
    packed = pack_tables(c.tables, c.max_bytes - used)
    notes = [*c.notes, *(n for p in packed for n in p.notes())]
    report = c.report(notes).encode()
    if len(report) > report_reserve:  # the notes are a few short lines; this guards the bound all the same
        raise BundleTooLarge(f"the report takes {len(report)} bytes, over its {report_reserve}")
    members = {"report.html": report, **fixed, **{f"{p.name}.jsonl": p.data for p in packed}}
    sizes = {n: len(b) for n, b in members.items()}
    man = dumps(manifest(c, packed, sizes, notes), indent=1)
    if len(man) > MANIFEST_RESERVE:
        raise BundleTooLarge(f"the manifest takes {len(man)} bytes, over its {MANIFEST_RESERVE}")
    folder = folder_of(c.name)
    return [(f"{folder}/manifest.json", man), *((f"{folder}/{n}", b) for n, b in members.items())]

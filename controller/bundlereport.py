"""An incident bundle's HTML report: one self-contained page, its plots inline SVG drawn here.

Sections: what triggered the bundle, the top reasons we missed (the attribution's groups), TTFT over
time (every request a dot, misses red, the SLO target a line), the decisions timeline (each
instance's weight as a step line, and every decision as a mark on its subject's lane), the alerts
(bars from pending through firing to resolved) and the notes on what the bundle left out.

Offline by design: no script, no style sheet, font or image from anywhere else; everything the
page needs is in it, so it opens from a mail attachment or an air-gapped laptop. Every stored
string is HTML-escaped. Pure: rows in, a string out.
"""

from __future__ import annotations

import html
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any, Final

MAX_POINTS: Final = 2000  # TTFT dots drawn at most (every k-th record beyond)
MAX_ROWS: Final = 50  # table rows shown at most; the .jsonl members hold them all
MAX_LANES: Final = 24
W: Final = 880
PAD_L: Final = 150
PAD_R: Final = 16
PAD_T: Final = 12
PAD_B: Final = 28
COLORS: Final = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
Mark = tuple[int, float, float | None, str, str]  # lane, start, end (None: a tick), color, tooltip
STATE_COLORS: Final = {"pending": "#f0ad4e", "firing": "#d9534f", "resolved": "#5cb85c"}

_CSS: Final = """
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:960px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;width:100%}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.muted{color:#777}.note{color:#8a6d3b}
svg{background:#fff;border:1px solid #eee}text{font-size:10px;fill:#444}
"""


@dataclass(frozen=True)
class ReportInput:
    """What the report shows. Rows are as the bundle stores them (column name -> value)."""

    name: str
    lo: float
    hi: float
    created_at: float
    attribution: Mapping[str, Any]
    records: Sequence[Mapping[str, Any]]
    decisions: Sequence[Mapping[str, Any]]
    alerts: Sequence[Mapping[str, Any]]
    ttft_target_s: float | None = None
    trigger: Mapping[str, Any] | None = None
    notes: Sequence[str] = field(default=())


def _e(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.6g}"
    return html.escape("" if value is None else str(value), quote=True)


def _utc(ts: float | None, *, date: bool = True) -> str:
    if ts is None:
        return ""
    fmt = "%Y-%m-%d %H:%M:%S UTC" if date else "%H:%M:%S"
    return datetime.fromtimestamp(ts, UTC).strftime(fmt)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class _Axes:
    """Maps (time, value) to the plot's pixels: time lo..hi across, value 0..top up."""

    def __init__(self, lo: float, hi: float, top: float, height: int) -> None:
        self.lo, self.hi = lo, hi if hi > lo else lo + 1.0
        self.top = top if top > 0 else 1.0
        self.h = height

    def x(self, ts: float) -> float:
        span = self.hi - self.lo
        return PAD_L + (min(max(ts, self.lo), self.hi) - self.lo) / span * (W - PAD_L - PAD_R)

    def y(self, v: float) -> float:
        return PAD_T + (1 - min(max(v, 0.0), self.top) / self.top) * (self.h - PAD_T - PAD_B)

    def time_ticks(self) -> str:
        out = []
        for k in range(6):
            ts = self.lo + (self.hi - self.lo) * k / 5
            x = self.x(ts)
            anchor = "start" if k == 0 else "end" if k == 5 else "middle"
            out.append(
                f'<line x1="{x:.1f}" y1="{self.h - PAD_B}" x2="{x:.1f}" y2="{self.h - PAD_B + 4}" '
                f'stroke="#999"/><text x="{x:.1f}" y="{self.h - 8}" text-anchor="{anchor}">'
                f"{_utc(ts, date=False)}</text>"
            )
        return "".join(out)

    def value_ticks(self, fmt: str, scale: float = 1.0) -> str:
        out = []
        for k in range(5):
            v = self.top * k / 4
            y = self.y(v)
            out.append(
                f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#f0f0f0"/>'
                f'<text x="{PAD_L - 4}" y="{y + 3:.1f}" text-anchor="end">{fmt.format(v * scale)}</text>'
            )
        return "".join(out)

    def frame(self, body: str, label: str) -> str:
        return (
            f'<svg width="{W}" height="{self.h}" '
            f'viewBox="0 0 {W} {self.h}" role="img" aria-label="{_e(label)}">'
            f'<line x1="{PAD_L}" y1="{self.h - PAD_B}" x2="{W - PAD_R}" y2="{self.h - PAD_B}" stroke="#999"/>'
            f"{body}{self.time_ticks()}</svg>"
        )


def ttft_points(
    records: Sequence[Mapping[str, Any]], limit: int = MAX_POINTS
) -> list[tuple[float, float, bool]]:
    """(arrival, TTFT s, met every SLO) of the records with a TTFT, every k-th past ``limit``."""
    pts = []
    for r in records:
        ts, ttft = _num(r.get("proxy_in")), _num(r.get("ttft_s"))
        if ts is not None and ttft is not None:
            pts.append((ts, ttft, r.get("slo_met") is True))
    step = -(-len(pts) // limit) if len(pts) > limit else 1
    return pts[::step]


def ttft_svg(inp: ReportInput) -> str:
    pts = ttft_points(inp.records)
    if not pts:
        return '<p class="muted">No request record with a TTFT in the window.</p>'
    target = inp.ttft_target_s
    top = max(max(p[1] for p in pts), target or 0.0) * 1.1
    ax = _Axes(inp.lo, inp.hi, top, 260)
    dots = "".join(
        f'<circle cx="{ax.x(ts):.1f}" cy="{ax.y(v):.1f}" r="2" fill="{"#1f77b4" if ok else "#d9534f"}" '
        f'fill-opacity="0.7"/>'
        for ts, v, ok in pts
    )
    line = ""
    if target is not None:
        y = ax.y(target)
        line = (
            f'<line x1="{PAD_L}" y1="{y:.1f}" x2="{W - PAD_R}" y2="{y:.1f}" stroke="#d9534f" '
            f'stroke-dasharray="4 3"/><text x="{W - PAD_R - 2}" y="{y - 3:.1f}" text-anchor="end">'
            f"TTFT target {target * 1000:.0f} ms</text>"
        )
    missed = sum(1 for p in pts if not p[2])
    caption = (
        f'<p class="muted">{len(pts)} requests drawn ({missed} red: missed an SLO or failed); TTFT in ms.</p>'
    )
    return ax.frame(ax.value_ticks("{:.0f}", 1000.0) + line + dots, "TTFT over time") + caption


def weight_series(
    decisions: Sequence[Mapping[str, Any]], lo: float, hi: float
) -> dict[str, list[tuple[float, float]]]:
    """Each instance's weight as steps (time, weight) from ``lo`` to ``hi``, from its weight decisions."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for d in sorted(decisions, key=lambda d: _num(d.get("ts")) or 0.0):
        if d.get("field") != "weight" or d.get("subject_kind", "instance") != "instance":
            continue
        ts, new = _num(d.get("ts")), _num(d.get("new_value"))
        if ts is None or new is None:
            continue
        s = out[str(d.get("subject"))]
        if not s:
            old = _num(d.get("old_value"))
            s.append((lo, new if old is None else old))
        s.append((ts, new))
    for s in out.values():
        s.append((hi, s[-1][1]))
    return dict(out)


def weights_svg(inp: ReportInput) -> str:
    series = weight_series(inp.decisions, inp.lo, inp.hi)
    if not series:
        return '<p class="muted">No weight decision in the window: every instance kept its weight.</p>'
    ax = _Axes(inp.lo, inp.hi, 1.05, 220)
    body, legend = [], []
    for k, (name, steps) in enumerate(sorted(series.items())[:MAX_LANES]):
        color = COLORS[k % len(COLORS)]
        path = [f"M{ax.x(steps[0][0]):.1f},{ax.y(steps[0][1]):.1f}"]
        for (_, prev), (ts, w) in pairwise(steps):
            path.append(f"L{ax.x(ts):.1f},{ax.y(prev):.1f}L{ax.x(ts):.1f},{ax.y(w):.1f}")
        body.append(f'<path d="{"".join(path)}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        legend.append(f'<span style="color:{color}">&#9632;</span> {_e(name)}')
    return ax.frame(ax.value_ticks("{:.2f}") + "".join(body), "instance weights") + (
        f'<p class="muted">Served weight per instance: {" &nbsp; ".join(legend)}</p>'
    )


def _lanes_svg(
    lanes: Sequence[str],
    marks: Sequence[tuple[int, float, float | None, str, str]],
    ax_lo: float,
    ax_hi: float,
) -> str:
    """One lane per name; a mark is (lane, start, end or None for a tick, color, tooltip)."""
    h = PAD_T + PAD_B + 18 * len(lanes)
    ax = _Axes(ax_lo, ax_hi, 1.0, h)
    body = []
    for k, name in enumerate(lanes):
        y = PAD_T + 18 * k
        body.append(
            f'<text x="{PAD_L - 4}" y="{y + 12}" text-anchor="end">{_e(name[:26])}</text>'
            f'<line x1="{PAD_L}" y1="{y + 9}" x2="{W - PAD_R}" y2="{y + 9}" stroke="#f0f0f0"/>'
        )
    for lane, start, end, color, tip in marks:
        y = PAD_T + 18 * lane
        x0 = ax.x(start)
        if end is None:
            body.append(
                f'<rect x="{x0 - 1.5:.1f}" y="{y + 2}" width="3" height="14" fill="{color}">'
                f"<title>{_e(tip)}</title></rect>"
            )
        else:
            width = max(2.0, ax.x(end) - x0)
            body.append(
                f'<rect x="{x0:.1f}" y="{y + 3}" width="{width:.1f}" height="12" fill="{color}" '
                f'fill-opacity="0.8"><title>{_e(tip)}</title></rect>'
            )
    return ax.frame("".join(body), "timeline")


def decisions_svg(inp: ReportInput) -> str:
    if not inp.decisions:
        return '<p class="muted">No decision stored in the window.</p>'
    lanes = sorted({str(d.get("subject")) for d in inp.decisions})[:MAX_LANES]
    index = {n: k for k, n in enumerate(lanes)}
    reasons = sorted({str(d.get("reason")) for d in inp.decisions})
    color = {r: COLORS[k % len(COLORS)] for k, r in enumerate(reasons)}
    marks: list[Mark] = []
    for d in inp.decisions:
        ts, lane = _num(d.get("ts")), index.get(str(d.get("subject")))
        if ts is None or lane is None:
            continue
        tip = f"{_utc(ts)} {d.get('subject')} {d.get('field')}: {d.get('old_value')} -> {d.get('new_value')} "
        marks.append((lane, ts, None, color[str(d.get("reason"))], tip + f"({d.get('reason')})"))
    legend = " &nbsp; ".join(f'<span style="color:{color[r]}">&#9632;</span> {_e(r)}' for r in reasons)
    return _lanes_svg(lanes, marks, inp.lo, inp.hi) + f'<p class="muted">Decisions by reason: {legend}</p>'


def alerts_svg(inp: ReportInput) -> str:
    if not inp.alerts:
        return '<p class="muted">No alert was active in the window.</p>'
    keyed = [(_alert_key(a), a) for a in inp.alerts]
    lanes = sorted({k for k, _ in keyed})[:MAX_LANES]
    index = {n: k for k, n in enumerate(lanes)}
    marks: list[Mark] = []
    for key, a in keyed:
        lane = index.get(key)
        since, fired, resolved = (_num(a.get(k)) for k in ("active_since", "fired_at", "resolved_at"))
        if lane is None or since is None:
            continue
        end = resolved if resolved is not None else inp.hi
        if fired is None:
            marks.append(
                (lane, since, max(since, _num(a.get("last_eval")) or since), STATE_COLORS["pending"], key)
            )
            continue
        marks.append((lane, since, fired, STATE_COLORS["pending"], f"{key} pending"))
        marks.append((lane, fired, end, STATE_COLORS["firing"], f"{key} firing since {_utc(fired)}"))
        if resolved is not None:
            marks.append((lane, resolved, None, STATE_COLORS["resolved"], f"{key} resolved {_utc(resolved)}"))
    legend = " &nbsp; ".join(f'<span style="color:{c}">&#9632;</span> {s}' for s, c in STATE_COLORS.items())
    return _lanes_svg(lanes, marks, inp.lo, inp.hi) + f'<p class="muted">{legend}</p>'


def _alert_key(a: Mapping[str, Any]) -> str:
    raw = a.get("labels")
    labels: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    where = labels.get("instance") or labels.get("pool") or ""
    return f"{a.get('rule')} {where}".strip()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], total: int) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows[:MAX_ROWS])
    more = (
        f'<p class="muted">{total - MAX_ROWS} more in the bundle\'s .jsonl member.</p>'
        if total > MAX_ROWS
        else ""
    )
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def reasons_html(attribution: Mapping[str, Any]) -> str:
    summary = f"<p>{_e(attribution.get('summary', ''))}</p>"
    top = attribution.get("top") or []
    if not top:
        return summary
    items = "".join(f"<li>{_e(g.get('message'))}</li>" for g in top if isinstance(g, Mapping))
    rows = [
        (
            g.get("stage"),
            g.get("place"),
            g.get("cause"),
            f"{100 * float(g.get('share') or 0):.0f}%",
            g.get("count"),
            _utc(_num(g.get("since"))),
        )
        for g in (attribution.get("groups") or [])
        if isinstance(g, Mapping)
    ]
    return f"{summary}<ol>{items}</ol>" + _table(
        ("stage", "place", "cause", "share", "misses", "since"), rows, len(rows)
    )


def trigger_html(inp: ReportInput) -> str:
    t = inp.trigger
    window = f"Window {_utc(inp.lo)} .. {_utc(inp.hi)} ({inp.hi - inp.lo:.0f} s)."
    if t is None:
        return f"<p>Written on demand (pdscope bundle). {window}</p>"
    labels = ", ".join(f"{k}={v}" for k, v in sorted((t.get("labels") or {}).items()))
    return (
        f"<p><b>{_e(t.get('alertname'))}</b> ({_e(t.get('severity'))}) {_e(labels)} fired at "
        f"{_utc(_num(t.get('fired_at')))}: {_e(t.get('description'))}</p><p>{window}</p>"
    )


def render(inp: ReportInput) -> str:
    """The report: a complete HTML document, self-contained."""
    decision_rows = [
        (
            _utc(_num(d.get("ts"))),
            d.get("subject"),
            d.get("field"),
            d.get("old_value"),
            d.get("new_value"),
            d.get("reason"),
            d.get("message"),
        )
        for d in sorted(inp.decisions, key=lambda d: _num(d.get("ts")) or 0.0, reverse=True)
    ]
    alert_rows = [
        (
            a.get("rule"),
            _alert_key(a).removeprefix(str(a.get("rule"))).strip(),
            a.get("state"),
            a.get("severity"),
            _utc(_num(a.get("active_since"))),
            _utc(_num(a.get("fired_at"))),
            _utc(_num(a.get("resolved_at"))),
            a.get("value"),
        )
        for a in inp.alerts
    ]
    notes = "".join(f'<li class="note">{_e(n)}</li>' for n in inp.notes)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(inp.name)}</title><style>{_CSS}</style></head><body>",
        "<h1>pdscope incident bundle</h1>",
        f'<p class="muted">{_e(inp.name)}, written {_utc(inp.created_at)}</p>',
        "<h2>What triggered it</h2>",
        trigger_html(inp),
        "<h2>The top reasons we missed</h2>",
        reasons_html(inp.attribution),
        "<h2>TTFT over time</h2>",
        ttft_svg(inp),
        "<h2>Decisions</h2>",
        weights_svg(inp),
        decisions_svg(inp),
        _table(
            ("time", "subject", "field", "old", "new", "reason", "message"), decision_rows, len(decision_rows)
        )
        if decision_rows
        else "",
        "<h2>Alerts</h2>",
        alerts_svg(inp),
        _table(
            ("rule", "where", "state", "severity", "active since", "fired", "resolved", "value"),
            alert_rows,
            len(alert_rows),
        )
        if alert_rows
        else "",
        "<h2>What this bundle left out</h2>",
        f"<ul>{notes}</ul>" if notes else '<p class="muted">Nothing: every row of the window is inside.</p>',
        "</body></html>",
    ]
    return "\n".join(parts)

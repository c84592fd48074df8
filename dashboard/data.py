"""Cached reads for the pages: each function takes the store URL and a window (plain,
hashable values), gets the shared read-only engine and calls one query module.

Results are cached with ``st.cache_data(ttl=CACHE_TTL_S)``, keyed by the arguments' values (:func:`_cached`);
windows are rounded to the refresh step (``View.window``), so concurrent viewers and reruns hit the cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import pandas as pd
import streamlit as st

from dashboard import prefix, summaries
from dashboard.api import ControllerClient, ControllerError
from dashboard.context import engine_for
from dashboard.queries import common, control, fleet, investigate, predictor, records, tenants
from dashboard.queries import requests as rq
from pdscope.config import SLOSettings, TenantSettings
from store.attribution import trusted_records

CACHE_TTL_S = 5.0

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _cached(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``st.cache_data(ttl=CACHE_TTL_S)``, keyed by the arguments' values however a caller passes them.

    Streamlit keys a call by its arguments as written: ``f(a, slo=x)`` and ``f(a, slo=x, senders=None)``
    were two entries, so the Capacity page read the same 20,000-row sample twice. Each call is bound to
    the signature, defaults filled in, before the cache sees it."""
    inner = st.cache_data(ttl=CACHE_TTL_S, show_spinner=False)(fn)
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return inner(*bound.args, **bound.kwargs)

    return call


@_cached
def presence(url: str) -> common.Presence:
    return common.presence(engine_for(url))


@_cached
def latest_ts(url: str) -> float | None:
    return common.latest_ts(engine_for(url))


@_cached
def snapshot_series(url: str, start: float, end: float) -> pd.DataFrame:
    return fleet.snapshot_series(engine_for(url), common.Window(start, end))


@_cached
def fleet_health(url: str, start: float, end: float) -> pd.DataFrame:
    """Per-instance health over the window (see ``summaries.instance_health``)."""
    engine, window = engine_for(url), common.Window(start, end)
    latest = fleet.latest_snapshots(engine, end)
    if latest.empty:
        return pd.DataFrame()
    edges = fleet.histogram_edges(engine, window, list(latest["instance"]))
    series = snapshot_series(url, start, end)
    return summaries.instance_health(series, latest, edges, fleet.current_weights(engine, end))


@_cached
def pool_limits(url: str, end: float) -> pd.DataFrame:
    return fleet.pool_limits(engine_for(url), end)


@_cached
def active_overrides(url: str, now: float) -> pd.DataFrame:
    return fleet.active_overrides(engine_for(url), now)


@_cached
def nixl_per_instance(url: str, start: float, end: float) -> pd.DataFrame:
    engine, window = engine_for(url), common.Window(start, end)
    series = snapshot_series(url, start, end)
    names = sorted(series["instance"].unique()) if not series.empty else []
    return summaries.nixl_per_instance(series, fleet.histogram_edges(engine, window, names))


@_cached
def handoff(url: str, start: float, end: float, by: str) -> pd.DataFrame:
    """Handoff percentiles per pair / D / P, in ms (see ``summaries.handoff_by``)."""
    sample, _ = request_sample(url, start, end)
    return summaries.handoff_by(sample, by)


@_cached
def slo_summary(
    url: str,
    start: float,
    end: float,
    slo: SLOSettings | None = None,
    senders: tuple[str, ...] | None = None,
) -> dict[str, Any] | None:
    """The window's SLO headline (same definitions as ``store.queries.slo_summary``, computed
    from bounded reads so a million-row window stays under a second); verdicts under ``slo``; only
    records from ``senders`` (``store.attribution.trusted_senders``; None: every record)."""
    width = common.Window(start, end).bucket_s(60)
    sample, _ = request_sample(url, start, end, slo=slo, senders=senders)
    return summaries.slo_figures(sample, slo_buckets(url, start, end, width, slo, senders), end - start)


# Above this many requests in a range, per-bucket counts are estimated from the sample.
EXACT_BUCKETS_MAX_ROWS = 250_000


@_cached
def slo_buckets(
    url: str,
    start: float,
    end: float,
    width_s: float,
    slo: SLOSettings | None = None,
    senders: tuple[str, ...] | None = None,
) -> pd.DataFrame:
    """Per-bucket request counts: exact, or scaled from the sample for very large ranges
    (then every row has ``estimated`` True); verdicts under ``slo`` (None: as stored); only records
    from ``senders`` (None: every record)."""
    sample, step = request_sample(url, start, end, slo=slo, senders=senders)
    if step * len(sample) > EXACT_BUCKETS_MAX_ROWS:
        return summaries.buckets_from_sample(sample, step, start, width_s).assign(estimated=True)
    only = trusted_records(senders)
    return records.slo_buckets(engine_for(url), common.Window(start, end), width_s, slo, only).assign(
        estimated=False
    )


@_cached
def request_sample(
    url: str,
    start: float,
    end: float,
    max_rows: int = 20_000,
    slo: SLOSettings | None = None,
    senders: tuple[str, ...] | None = None,
) -> tuple[pd.DataFrame, int]:
    """``records.sample`` of the window; only records from ``senders`` (None: every record)."""
    window = common.Window(start, end)
    return records.sample(engine_for(url), window, max_rows, slo, only=trusted_records(senders))


@_cached
def prefix_sample(url: str, start: float, end: float, max_rows: int = 20_000) -> tuple[pd.DataFrame, int]:
    """The window's records as the Prefix cache page reads them (every k-th by id; k returned)."""
    return records.sample(
        engine_for(url), common.Window(start, end), max_rows, columns=records.PREFIX_COLUMNS
    )


@_cached
def prefix_series(url: str, start: float, end: float) -> pd.DataFrame:
    """The snapshots' prefix-cache counters in the window (thinned like ``snapshot_series``)."""
    return fleet.snapshot_series(engine_for(url), common.Window(start, end), prefix.SERIES_COLUMNS)


@_cached
def search_requests(
    url: str,
    start: float,
    end: float,
    request_id: str,
    status: str,
    instance: str,
    slo_miss: bool,
    lease_expiry: bool,
    limit: int = 200,
) -> pd.DataFrame:
    flt = rq.RequestFilter(request_id, status, instance, slo_miss, lease_expiry, limit)
    return rq.search(engine_for(url), common.Window(start, end), flt)


@_cached
def status_counts(url: str, start: float, end: float) -> pd.DataFrame:
    return rq.status_counts(engine_for(url), common.Window(start, end))


@st.cache_data(ttl=60.0, show_spinner=False)
def get_request(url: str, request_id: str) -> dict[str, Any] | None:
    return rq.get_request(engine_for(url), request_id)


@st.cache_data(ttl=60.0, show_spinner=False)
def nixl_around(url: str, instance: str, start: float, end: float) -> pd.DataFrame:
    return rq.nixl_around(engine_for(url), instance, start, end)


@_cached
def decisions(url: str, start: float, end: float) -> pd.DataFrame:
    return control.decisions(engine_for(url), common.Window(start, end))


@_cached
def weight_history(url: str, start: float, end: float) -> pd.DataFrame:
    return control.weight_history(engine_for(url), common.Window(start, end))


@_cached
def latest_mode(url: str) -> str | None:
    return control.latest_mode(engine_for(url))


@_cached
def firing_alerts(url: str) -> pd.DataFrame:
    return control.firing_alerts(engine_for(url))


@_cached
def recent_alerts(url: str, start: float, end: float) -> pd.DataFrame:
    return control.recent_alerts(engine_for(url), common.Window(start, end))


@_cached
def audit_trail(url: str, start: float, end: float) -> pd.DataFrame:
    return control.audit_trail(engine_for(url), common.Window(start, end))


@_cached
def routing_table(controller_url: str) -> dict[str, Any] | None:
    """The controller's current routing table (served weights, drains, mode), or None when
    it does not answer within 1.5 s."""
    try:
        return ControllerClient(controller_url, None, timeout_s=1.5).routing()
    except ControllerError:
        return None


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


@_cached
def proxies(url: str, now: float, ttl_s: float) -> pd.DataFrame:
    from dashboard.queries import proxies as px

    return px.proxies(engine_for(url), now, ttl_s)


@_cached
def attribution(
    url: str, start: float, end: float, slo: SLOSettings, senders: tuple[str, ...] | None
) -> investigate.WindowAttribution:
    """Why the window's requests missed their SLO (``dashboard.queries.investigate.attribution``)."""
    return investigate.attribution(engine_for(url), start, end, slo, senders)


@_cached
def regret(
    url: str,
    start: float,
    end: float,
    slo: SLOSettings,
    senders: tuple[str, ...] | None,
    interval_s: float,
    flap_ticks: int = 10,
) -> investigate.WindowRegret:
    """What followed the controller's cuts in the window, judged on the data up to its end."""
    cfg = investigate.regret_config(flap_ticks=flap_ticks, tick_s=interval_s, slo_window_s=slo.window_s)
    return investigate.regret(engine_for(url), start, end, end, slo, senders, cfg)


@_cached
def prediction(
    url: str, start: float, end: float, senders: tuple[str, ...] | None
) -> predictor.WindowPrediction:
    """The TTFT predictions of the window against the observed TTFT (``dashboard.queries.predictor``)."""
    return predictor.prediction(engine_for(url), start, end, senders)


@_cached
def tenant_window(
    url: str,
    start: float,
    end: float,
    senders: tuple[str, ...] | None,
    declared: TenantSettings,
    slo: SLOSettings,
) -> tenants.WindowTenants:
    """Each declared tenant's figures over the window (``dashboard.queries.tenants``)."""
    return tenants.tenants(engine_for(url), start, end, senders, declared, slo)

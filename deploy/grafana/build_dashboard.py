"""Builds deploy/grafana/pdscope-dashboard.json, the Grafana view of a P/D fleet on Prometheus.

Its rows mirror the Streamlit pages (fleet, KV transfer, prefix cache, SLOs & alerts,
controller, capacity) on the series that deploy/prometheus/ scrapes and records. The JSON is the
artifact Grafana loads; this script is the source it is generated from, so panels stay
consistent (ids, grid, datasource, variables). Edit here, then run
``python deploy/grafana/build_dashboard.py`` (``--check`` exits 1 if the JSON is stale).
Every PromQL expression in it is evaluated against a real Prometheus in
tests/deploy/test_real_prometheus.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pdscope.generated import write_or_check

OUT = Path(__file__).with_name("pdscope-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
P = 'pool=~"$pool"'
PI = 'pool=~"$pool",instance=~"$instance"'
RI = "$__rate_interval"


class _Layout:
    """Hands out panel ids and grid positions: rows of full width, panels 8 high."""

    def __init__(self) -> None:
        self.next_id = 1
        self.y = 0
        self.x = 0
        self.panels: list[dict[str, Any]] = []

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += 8
            self.x = 0
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self._id(),
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        kind: str = "timeseries",
        width: int = 8,
        description: str = "",
        thresholds: list[tuple[str, float | None]] | None = None,
    ) -> None:
        """A panel at the next free place; stat and table panels show instant values, the rest ranges."""
        instant = kind != "timeseries"
        if self.x + width > 24:
            self.y += 8
            self.x = 0
        steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
        panel: dict[str, Any] = {
            "type": kind,
            "title": title,
            "description": description,
            "id": self._id(),
            "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self.x, "y": self.y},
            "fieldConfig": {
                "defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                "overrides": [],
            },
            "options": {
                "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}
            }
            if kind == "timeseries"
            else {},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "instant": instant,
                    "range": not instant,
                }
                for i, (expr, legend) in enumerate(targets)
            ],
        }
        self.panels.append(panel)
        self.x += width

    def stat(self, title: str, targets: list[tuple[str, str]], **options: Any) -> None:
        self.panel(title, targets, kind="stat", **options)


UP = [("red", None), ("green", 1)]
"""Thresholds of an up-style stat: red at 0, green at 1."""


def _above(red: float, orange: float | None = None) -> list[tuple[str, float | None]]:
    """Thresholds green below ``orange`` (when given) and ``red``, orange, then red from ``red`` up."""
    warn: list[tuple[str, float | None]] = [("orange", orange)] if orange is not None else []
    return [("green", None), *warn, ("red", red)]


def _variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "definition": query,
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "refresh": 1,
        },
        query_var("pool", "pool", "label_values(vllm:num_requests_running, pool)"),
        query_var("instance", "instance", 'label_values(vllm:num_requests_running{pool=~"$pool"}, instance)'),
    ]


def _selected(metric: str, sel: str) -> str:
    """``metric{sel}``, or the bare metric when there is no selector."""
    return f"{metric}{{{sel}}}" if sel else metric


def _agg(op: str, by: str, inner: str) -> str:
    """``op by (by) (inner)``, or ``op(inner)`` when ``by`` is empty."""
    return f"{op} by ({by}) ({inner})" if by else f"{op}({inner})"


def _gauge(op: str, metric: str, sel: str = PI, by: str = "instance") -> str:
    """A gauge aggregated over its series: ``max by (instance) (metric{sel})``."""
    return _agg(op, by, _selected(metric, sel))


def _rate(metric: str, sel: str = PI, by: str = "instance", window: str = RI) -> str:
    """A counter's rate, summed: ``sum by (instance) (rate(metric{sel}[window]))``."""
    return _agg("sum", by, f"rate({_selected(metric, sel)}[{window}])")


def _quantile(q: float, histogram: str, sel: str = PI, by: str = "pool") -> str:
    """A histogram's quantile over ``by``: ``histogram_quantile(q, sum by (by, le) (rate(h_bucket…)))``."""
    by_le = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, {_rate(f'{histogram}_bucket', sel, by_le)})"


def _ratio(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


def build() -> dict[str, Any]:
    g = _Layout()
    g.row("Fleet")
    _fleet(g)
    g.row("KV transfer (NIXL)")
    _kv_transfer(g)
    g.row("Prefix cache & KV-aware routing")
    _prefix_cache(g)
    _kv_view_health(g)
    g.row("SLOs & alerts")
    _slos(g)
    g.row("Controller & proxy")
    _controller(g)
    _proxy(g)
    g.row("Capacity")
    _capacity(g)
    return {
        "title": "pdscope: vLLM prefill/decode fleet",
        "uid": "pdscope-pd-fleet",
        "description": (
            "vLLM P/D disaggregation with NIXL, as pdscope sees it; from deploy/grafana/build_dashboard.py"
        ),
        "tags": ["pdscope", "vllm", "nixl"],
        "timezone": "utc",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables()},
        "annotations": {
            "list": [
                {
                    "name": "Firing alerts",
                    "datasource": DS,
                    "enable": True,
                    "iconColor": "red",
                    "expr": 'ALERTS{alertstate="firing"}',
                    "titleFormat": "{{alertname}}",
                    "textFormat": "{{instance}}",
                }
            ]
        },
        "panels": g.panels,
    }


def _fleet(g: _Layout) -> None:
    g.stat(
        "Instances up",
        [(f'up{{job="vllm",{PI}}}', "{{role}} {{instance}}")],
        thresholds=UP,
        description="1 when Prometheus scraped the instance's /metrics on its last try.",
    )
    g.panel(
        "Requests running / waiting",
        [
            (_gauge("sum", "vllm:num_requests_running"), "running {{instance}}"),
            (_gauge("sum", "vllm:num_requests_waiting"), "waiting {{instance}}"),
        ],
        width=16,
        description="vLLM's scheduler gauges; on decode, waiting includes requests waiting for remote KV.",
    )
    g.panel(
        "Finished requests/s by pool",
        [(_selected("pool_role:vllm_request_success:rate5m", P), "{{role}} {{pool}}")],
        unit="reqps",
    )
    g.panel(
        "Tokens/s",
        [
            (
                _rate("vllm:prompt_tokens_by_source_total", f'{PI},source="local_compute"', "pool"),
                "prefill computed {{pool}}",
            ),
            (_rate("vllm:generation_tokens_total", f'{PI},role="decode"', "pool"), "generated {{pool}}"),
        ],
    )
    g.panel(
        "KV usage",
        [(_gauge("max", "vllm:kv_cache_usage_perc"), "{{instance}}")],
        unit="percentunit",
        thresholds=_above(0.95, orange=0.9),
        description="On prefill this includes blocks leased to decode instances until they pull them.",
    )


def _kv_transfer(g: _Layout) -> None:
    xfer = "vllm:nixl_xfer_time_seconds"
    sent = _rate("vllm:nixl_bytes_transferred_sum")
    g.panel(
        "NIXL transfer time p50 / p99",
        [(_quantile(0.5, xfer), "p50 {{pool}}"), (_quantile(0.99, xfer), "p99 {{pool}}")],
        unit="s",
        description="Per transfer handle, recorded by the pulling (decode) instance.",
    )
    g.panel("NIXL throughput", [(sent, "bytes/s {{instance}}")], unit="Bps")
    g.panel(
        "Bytes per transfer-second",
        [(_ratio(sent, _rate(f"{xfer}_sum")), "{{instance}}")],
        unit="Bps",
        description="Link speed while transferring: a drop means a slow link, not more load.",
    )
    g.panel(
        "NIXL failures and lease expiries",
        [
            (_rate("vllm:nixl_num_failed_transfers_total"), "failed {{instance}}"),
            (_rate("vllm:nixl_num_kv_expired_reqs_total"), "lease expiries {{instance}}"),
            (_rate("vllm:nixl_num_notifications_after_expiry_total"), "notif after expiry {{instance}}"),
        ],
        unit="ops",
    )
    g.panel(
        "Failed transfer ratio",
        [(_selected("instance:vllm_nixl_failed_transfers:ratio_rate5m", PI), "{{instance}}")],
        unit="percentunit",
        thresholds=_above(0.01),
    )
    g.panel(
        "Decode requests waiting for KV, by stage",
        [
            (
                _gauge("sum", "vllm:num_requests_kv_fetch_by_stage", by="instance, stage"),
                "{{stage}} {{instance}}",
            )
        ],
    )


def _slos(g: _Layout) -> None:
    requests = "vllm:request_success_total"
    g.panel(
        "TTFT p99 per stage vs target",
        [
            (_selected("pool_role:vllm_time_to_first_token_seconds:p99_rate5m", P), "{{role}} {{pool}}"),
            (_quantile(0.99, "pdscope_proxy_time_to_first_token_seconds", "", ""), "proxy (end to end)"),
            ("pdscope:slo_ttft_seconds:target", "target"),
        ],
        unit="s",
    )
    g.panel(
        "Inter-token latency and TPOT p99 vs target",
        [
            (_selected("pool_role:vllm_inter_token_latency_seconds:p99_rate5m", P), "ITL {{pool}}"),
            (
                _selected("pool_role:vllm_request_time_per_output_token_seconds:p99_rate5m", P),
                "TPOT {{pool}}",
            ),
            ("pdscope:slo_tpot_seconds:target", "target"),
        ],
        unit="s",
    )
    g.panel(
        "Request errors",
        [
            (
                _ratio(_rate(requests, f'{P},finished_reason="error"', "pool"), _rate(requests, P, "pool")),
                "{{pool}}",
            )
        ],
        unit="percentunit",
        thresholds=_above(0.01),
    )
    g.panel(
        "Goodput attainment vs target",
        [("pdscope_slo_attainment", "attainment"), ("pdscope:slo_goodput_attainment:target", "target")],
        unit="percentunit",
        description="The controller's share of completed requests meeting every SLO (from request records).",
    )
    g.panel(
        "Goodput",
        [("pdscope_goodput_requests_per_second", "requests/s meeting every SLO")],
        unit="reqps",
    )
    g.panel(
        "Controller alerts firing",
        [(_gauge("sum", "pdscope_alerts_firing", "", "alertname"), "{{alertname}}")],
        description="pdscope's own alert rules, evaluated by the controller on its window; a Prometheus "
        "rule that alerts on the same condition has the same name.",
    )
    g.panel(
        "Firing alerts",
        [(_gauge("sum", "ALERTS", 'alertstate="firing"', "alertname, severity, pool, instance"), "")],
        kind="table",
        width=24,
        description="Alerts from deploy/prometheus/rules (source=prometheus), firing now. "
        "Runbook: deploy/prometheus/RUNBOOK.md.",
    )


def _controller(g: _Layout) -> None:
    g.panel(
        "Routing weight per instance",
        [(_gauge("max", "pdscope_instance_weight", by="instance, source"), "{{instance}} ({{source}})")],
        width=12,
        description="Served weights; source says whether the policy or a manual override set them.",
    )
    g.panel(
        "Policy weight and drained instances",
        [
            (_gauge("max", "pdscope_instance_policy_weight"), "policy {{instance}}"),
            (_gauge("max", "pdscope_instance_drained"), "drained {{instance}}"),
        ],
        width=12,
    )
    g.panel(
        "Routing table changes",
        [(f"changes(pdscope_routing_version[{RI}])", "new tables")],
        description="How often the controller publishes a new routing table (a decision changed something).",
    )
    g.panel(
        "Admission limits per pool",
        [(_gauge("max", "pdscope_pool_max_inflight_requests", P, "pool"), "max requests {{pool}}")],
    )
    g.panel(
        "Controller tick age",
        [("time() - max(pdscope_controller_last_success_timestamp_seconds)", "age")],
        unit="s",
        thresholds=_above(30, orange=10),
    )


def _proxy(g: _Layout) -> None:
    """The proxies' half of the "Controller & proxy" row, then the pdscope services' health."""
    _proxy_routing(g)
    _proxy_admission(g)
    _proxy_fleet(g)
    _services_up(g)


def _proxy_routing(g: _Layout) -> None:
    """Which table the proxies route by, how old it is, and what became of their requests."""
    g.stat(
        "Proxy routing state",
        [(_gauge("max", "pdscope_proxy_routing_state", "", "state"), "{{state}}")],
        description="fresh: the controller's table; static/fallback: the controller is unreachable.",
    )
    g.panel(
        "Routing table age",
        [("max(pdscope_proxy_routing_table_age_seconds)", "age")],
        unit="s",
        thresholds=_above(60, orange=10),
    )
    g.panel(
        "Proxy requests/s by outcome",
        [(_rate("pdscope_proxy_requests_total", "", "outcome"), "{{outcome}}")],
        unit="reqps",
    )


def _proxy_admission(g: _Layout) -> None:
    """The pools' admission: rejections, the handoffs in flight and their KV bytes, against the limit."""
    inflight = _gauge("sum", "pdscope_proxy_pool_inflight_requests", P, "pool")
    g.panel(
        "Proxy admission rejections (429)",
        [(_rate("pdscope_proxy_rejections_total", P, "pool, reason"), "{{pool}} {{reason}}")],
        unit="reqps",
    )
    g.panel("Handoff in flight", [(inflight, "requests {{pool}}")])
    g.panel(
        "Handoff KV bytes in flight",
        [(_gauge("sum", "pdscope_proxy_pool_inflight_kv_bytes", P, "pool"), "{{pool}}")],
        unit="bytes",
    )
    g.panel(
        "In flight vs the limit, all proxies",
        [
            (inflight, "in flight {{pool}}"),
            (
                _gauge("sum", "pdscope_proxy_pool_limit", f'kind="requests",{P}', "pool"),
                "slots held by the proxies {{pool}}",
            ),
        ],
        width=12,
        description="Each proxy enforces its part of a pool's limit (GET /v1/proxies): the parts add up "
        "to the pool's limit, so the fleet's in-flight stays under it however many proxies run.",
    )


def _proxy_fleet(g: _Layout) -> None:
    """The proxies and controllers that run (one leader, a part of the limit each) and the retries."""
    g.stat(
        "Proxies and controllers",
        [
            ("max(pdscope_controller_live_proxies)", "live proxies"),
            ("sum(pdscope_controller_leader)", "leaders (1)"),
            ("count(pdscope_proxy_limit_share) or vector(0)", "proxies with a part"),
            (
                'sum(increase(pdscope_controller_proxy_polls_total{outcome="duplicate_id"}[15m]))'
                " or vector(0)",
                "duplicate ids",
            ),
        ],
        width=12,
        description="Leaders must be exactly 1; a proxy without a part admits limit / expected_replicas.",
    )
    g.panel(
        "Retries by stage",
        [
            (_rate("pdscope_proxy_retries_total", "", "stage"), "{{stage}}"),
            (_rate("pdscope_proxy_retries_refused_total", "", "stage"), "refused {{stage}}"),
        ],
        unit="ops",
        width=12,
    )


def _services_up(g: _Layout) -> None:
    """pdscope's services as Prometheus scrapes them, and the collector's own scrapes."""
    g.stat(
        "pdscope services up",
        [('up{job=~"pdscope-.*"}', "{{job}}")],
        width=12,
        thresholds=UP,
    )
    g.stat(
        "Collector: targets up",
        [(_gauge("max", "pdscope_collector_target_up"), "{{instance}}")],
        width=12,
        thresholds=UP,
    )
    g.panel(
        "Collector: scrape duration",
        [
            (
                _gauge("max", "pdscope_collector_scrape_duration_seconds", 'instance=~"$instance"'),
                "{{instance}}",
            )
        ],
        unit="s",
        width=12,
    )


def _capacity(g: _Layout) -> None:
    def up(role: str) -> str:
        return f'count(up{{job="vllm",role="{role}"}} == 1)'

    g.stat(
        "Instances up by role, P:D ratio",
        [('sum by (role) (up{job="vllm"})', "{{role}}"), (_ratio(up("prefill"), up("decode")), "P:D")],
        width=6,
        description="Compare P:D with (decode capacity / prefill capacity) x (E[prompt] / E[output]).",
    )
    g.panel(
        "Prompt / output tokens per request",
        [
            (
                _ratio(
                    _rate("vllm:request_prompt_tokens_sum", f'role="decode",{P}', ""),
                    _rate("vllm:request_generation_tokens_sum", f'role="decode",{P}', ""),
                ),
                "E[prompt] / E[output]",
            ),
        ],
        width=6,
        description="The token mix that sets the P:D ratio a fleet needs (see the capacity page).",
    )
    computed = _rate("vllm:prompt_tokens_by_source_total", f'role="prefill",source="local_compute",{P}', "")
    generated = _rate("vllm:generation_tokens_total", f'role="decode",{P}', "")
    g.panel("Prefill tokens/s per prefill instance", [(_ratio(computed, up("prefill")), "per P")], width=6)
    g.panel("Generated tokens/s per decode instance", [(_ratio(generated, up("decode")), "per D")], width=6)
    g.panel(
        "Busiest KV cache per pool",
        [(_gauge("max", "vllm:kv_cache_usage_perc", P, "pool"), "{{pool}}")],
        unit="percentunit",
        width=12,
    )
    g.panel(
        "Queue time p99 per pool",
        [(_quantile(0.99, "vllm:request_queue_time_seconds", P), "{{pool}}")],
        unit="s",
        width=12,
        description="On decode, queue time includes the KV pull.",
    )


def _prefix_cache(g: _Layout) -> None:
    """vLLM's own prefix-cache hit rates and the proxy's KV-aware routes and predictions (proxy.kv_aware;
    series per vLLM instance, no pool label); the view's health follows (:func:`_kv_view_health`)."""
    hits = "vllm:prefix_cache_hits_total"
    ext = f'role="decode",{PI}'
    routes = "pdscope_proxy_routes_total"
    g.panel(
        "Prefix cache hit rate (vLLM)",
        [
            (
                _ratio(_rate(hits, window="5m"), _rate("vllm:prefix_cache_queries_total", window="5m")),
                "{{instance}}",
            ),
            (
                _ratio(
                    _rate("vllm:external_prefix_cache_hits_total", ext, window="5m"),
                    _rate("vllm:external_prefix_cache_queries_total", ext, window="5m"),
                ),
                "external {{instance}}",
            ),
        ],
        unit="percentunit",
        description="Share of queried prompt tokens found in the instance's own prefix cache; for D, "
        "external: the share found by its KV connector (pulled from P). A sudden fall: "
        "PrefixCacheHitRateCollapsed.",
    )
    g.panel(
        "Routes by path",
        [
            (_rate(routes, "", "path, reason"), "{{path}} {{reason}}"),
            (
                _ratio(_rate(routes, 'path="decode_only"', ""), _rate(routes, "", "")),
                "share served without P",
            ),
        ],
        unit="ops",
        description="pd: P then D; decode_only: D alone computed the uncached part of the prompt "
        "(conditional disaggregation). The reason says why the router chose as it did.",
    )
    g.panel(
        "Predicted cached tokens vs vLLM's hits",
        [
            (_rate("pdscope_proxy_predicted_cached_tokens_total", "", "role"), "predicted {{role}}"),
            (_rate(hits, P, "role"), "vLLM prefix hits {{role}}"),
            (_rate("pdscope_proxy_prompt_tokens_routed_total", "", ""), "prompt tokens routed"),
        ],
        description="Tokens per second: what the router predicted the chosen P and D held, beside the "
        "prefix hits vLLM counted. Predictions well above the hits: the router's view lags the caches.",
    )


def _kv_view_health(g: _Layout) -> None:
    """The health of the proxy's view of the caches: its KV events streams and indexes (precise mode),
    and per instance the share of its predictions vLLM bore out (either mode)."""
    inst = 'instance=~"$instance"'
    g.panel(
        "KV events stream age",
        [(_gauge("max", "pdscope_proxy_kv_events_last_message_age_seconds", inst), "{{instance}}")],
        unit="s",
        thresholds=_above(120),
        description="Seconds since the proxy's last KV events message from the instance (the oldest over "
        "the proxies; -1: none since the proxy started). Over 120 s, or -1, while the instance serves: "
        "KVEventsStreamStale.",
    )
    g.stat(
        "KV index stale",
        [(_gauge("max", "pdscope_proxy_kv_index_stale", inst), "{{instance}}")],
        thresholds=_above(1),
        description="1: the proxy does not trust its index of the instance's cache (a gap not "
        "replayed, drops) and routes to it on load alone. For 5 minutes: KVIndexStale.",
    )
    checked = "pdscope_proxy_kv_checked_cached_tokens_total"
    g.panel(
        "KV predictions that came true",
        [
            (
                _ratio(
                    _rate(checked, f'{inst},figure="reported"', window="15m"),
                    _rate(checked, f'{inst},figure="predicted"', window="15m"),
                ),
                "{{instance}}",
            ),
        ],
        unit="percentunit",
        description="Per instance, of the cached prompt tokens the proxy's view predicted it held, the share "
        "vLLM reported reusing (usage.prompt_tokens_details.cached_tokens), over 15 minutes. Under 50 %: "
        "KVPredictionsNotComingTrue (in approximate mode the view assumes the instance keeps more than "
        "it does).",
    )
    events = "pdscope_proxy_kv_events"
    g.panel(
        "KV events: messages, drops, gaps, replays",
        [
            (_rate(f"{events}_messages_total", inst), "messages {{instance}}"),
            (_rate(f"{events}_dropped_total", inst, "instance, reason"), "dropped {{reason}} {{instance}}"),
            (_rate(f"{events}_gaps_total", inst), "gaps {{instance}}"),
            (_rate(f"{events}_replays_total", inst, "instance, outcome"), "replays {{outcome}} {{instance}}"),
            (_rate(f"{events}_restarts_total", inst), "publisher restarts {{instance}}"),
        ],
        unit="ops",
    )


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(argv, __doc__, OUT, render, "deploy/grafana/build_dashboard.py")


if __name__ == "__main__":
    sys.exit(main())

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
        width: int = 12,
        description: str = "",
        thresholds: list[tuple[str, float | None]] | None = None,
        instant: bool = False,
    ) -> None:
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


def build() -> dict[str, Any]:
    g = _Layout()

    g.row("Fleet")
    g.panel(
        "Instances up",
        [(f'up{{job="vllm",{PI}}}', "{{role}} {{instance}}")],
        kind="stat",
        width=8,
        thresholds=[("red", None), ("green", 1)],
        instant=True,
        description="1 when Prometheus scraped the instance's /metrics on its last try.",
    )
    g.panel(
        "Requests running / waiting",
        [
            (f"sum by (instance) (vllm:num_requests_running{{{PI}}})", "running {{instance}}"),
            (f"sum by (instance) (vllm:num_requests_waiting{{{PI}}})", "waiting {{instance}}"),
        ],
        width=16,
        description="vLLM's scheduler gauges; on decode, waiting includes requests waiting for remote KV.",
    )
    g.panel(
        "Finished requests/s by pool",
        [
            (f"pool_role:vllm_request_success:rate5m{{{P}}}", "{{role}} {{pool}}"),
        ],
        unit="reqps",
        width=8,
    )
    g.panel(
        "Tokens/s",
        [
            (
                (
                    "sum by (pool) (rate(vllm:prompt_tokens_by_source_total"
                    f'{{{PI},source="local_compute"}}[{RI}]))'
                ),
                "prefill computed {{pool}}",
            ),
            (
                f'sum by (pool) (rate(vllm:generation_tokens_total{{{PI},role="decode"}}[{RI}]))',
                "generated {{pool}}",
            ),
        ],
        width=8,
    )
    g.panel(
        "KV usage",
        [(f"max by (instance) (vllm:kv_cache_usage_perc{{{PI}}})", "{{instance}}")],
        unit="percentunit",
        width=8,
        thresholds=[("green", None), ("orange", 0.9), ("red", 0.95)],
        description="On prefill this includes blocks leased to decode instances until they pull them.",
    )

    g.row("KV transfer (NIXL)")
    g.panel(
        "NIXL transfer time p50 / p99",
        [
            (
                (
                    "histogram_quantile(0.5, sum by (pool, le) "
                    f"(rate(vllm:nixl_xfer_time_seconds_bucket{{{PI}}}[{RI}])))"
                ),
                "p50 {{pool}}",
            ),
            (
                (
                    "histogram_quantile(0.99, sum by (pool, le) "
                    f"(rate(vllm:nixl_xfer_time_seconds_bucket{{{PI}}}[{RI}])))"
                ),
                "p99 {{pool}}",
            ),
        ],
        unit="s",
        width=8,
        description="Per transfer handle, recorded by the pulling (decode) instance.",
    )
    g.panel(
        "NIXL throughput",
        [
            (
                f"sum by (instance) (rate(vllm:nixl_bytes_transferred_sum{{{PI}}}[{RI}]))",
                "bytes/s {{instance}}",
            ),
        ],
        unit="Bps",
        width=8,
    )
    g.panel(
        "Bytes per transfer-second",
        [
            (
                f"sum by (instance) (rate(vllm:nixl_bytes_transferred_sum{{{PI}}}[{RI}]))"
                f" / sum by (instance) (rate(vllm:nixl_xfer_time_seconds_sum{{{PI}}}[{RI}]))",
                "{{instance}}",
            ),
        ],
        unit="Bps",
        width=8,
        description="Link speed while transferring: a drop means a slow link, not more load.",
    )
    g.panel(
        "NIXL failures and lease expiries",
        [
            (
                f"sum by (instance) (rate(vllm:nixl_num_failed_transfers_total{{{PI}}}[{RI}]))",
                "failed {{instance}}",
            ),
            (
                f"sum by (instance) (rate(vllm:nixl_num_kv_expired_reqs_total{{{PI}}}[{RI}]))",
                "lease expiries {{instance}}",
            ),
            (
                f"sum by (instance) (rate(vllm:nixl_num_notifications_after_expiry_total{{{PI}}}[{RI}]))",
                "notif after expiry {{instance}}",
            ),
        ],
        unit="ops",
        width=8,
    )
    g.panel(
        "Failed transfer ratio",
        [
            (f"instance:vllm_nixl_failed_transfers:ratio_rate5m{{{PI}}}", "{{instance}}"),
        ],
        unit="percentunit",
        width=8,
        thresholds=[("green", None), ("red", 0.01)],
    )
    g.panel(
        "Decode requests waiting for KV, by stage",
        [
            (
                f"sum by (instance, stage) (vllm:num_requests_kv_fetch_by_stage{{{PI}}})",
                "{{stage}} {{instance}}",
            ),
        ],
        width=8,
    )

    g.row("Prefix cache & KV-aware routing")
    _prefix_cache(g)

    g.row("SLOs & alerts")
    g.panel(
        "TTFT p99 per stage vs target",
        [
            (f"pool_role:vllm_time_to_first_token_seconds:p99_rate5m{{{P}}}", "{{role}} {{pool}}"),
            (
                (
                    "histogram_quantile(0.99, sum by (le) "
                    f"(rate(pdscope_proxy_time_to_first_token_seconds_bucket[{RI}])))"
                ),
                "proxy (end to end)",
            ),
            ("pdscope:slo_ttft_seconds:target", "target"),
        ],
        unit="s",
        width=8,
    )
    g.panel(
        "Inter-token latency and TPOT p99 vs target",
        [
            (f"pool_role:vllm_inter_token_latency_seconds:p99_rate5m{{{P}}}", "ITL {{pool}}"),
            (f"pool_role:vllm_request_time_per_output_token_seconds:p99_rate5m{{{P}}}", "TPOT {{pool}}"),
            ("pdscope:slo_tpot_seconds:target", "target"),
        ],
        unit="s",
        width=8,
    )
    g.panel(
        "Request errors",
        [
            (
                f'sum by (pool) (rate(vllm:request_success_total{{{P},finished_reason="error"}}[{RI}]))'
                f" / sum by (pool) (rate(vllm:request_success_total{{{P}}}[{RI}]))",
                "{{pool}}",
            ),
        ],
        unit="percentunit",
        width=8,
        thresholds=[("green", None), ("red", 0.01)],
    )
    g.panel(
        "Goodput attainment vs target",
        [
            ("pdscope_slo_attainment", "attainment"),
            ("pdscope:slo_goodput_attainment:target", "target"),
        ],
        unit="percentunit",
        width=8,
        description="The controller's share of completed requests meeting every SLO (from request records).",
    )
    g.panel(
        "Goodput",
        [("pdscope_goodput_requests_per_second", "requests/s meeting every SLO")],
        unit="reqps",
        width=8,
    )
    g.panel(
        "Controller alerts firing",
        [("sum by (alertname) (pdscope_alerts_firing)", "{{alertname}}")],
        width=8,
        description="pdscope's own alert rules, evaluated by the controller on its window; a Prometheus "
        "rule that alerts on the same condition has the same name.",
    )
    g.panel(
        "Firing alerts",
        [('sum by (alertname, severity, pool, instance) (ALERTS{alertstate="firing"})', "")],
        kind="table",
        width=24,
        instant=True,
        description="Alerts from deploy/prometheus/rules (source=prometheus), firing now. "
        "Runbook: deploy/prometheus/RUNBOOK.md.",
    )

    g.row("Controller & proxy")
    g.panel(
        "Routing weight per instance",
        [
            (f"max by (instance, source) (pdscope_instance_weight{{{PI}}})", "{{instance}} ({{source}})"),
        ],
        width=12,
        description="Served weights; source says whether the policy or a manual override set them.",
    )
    g.panel(
        "Policy weight and drained instances",
        [
            (f"max by (instance) (pdscope_instance_policy_weight{{{PI}}})", "policy {{instance}}"),
            (f"max by (instance) (pdscope_instance_drained{{{PI}}})", "drained {{instance}}"),
        ],
        width=12,
    )
    g.panel(
        "Routing table changes",
        [(f"changes(pdscope_routing_version[{RI}])", "new tables")],
        width=8,
        description="How often the controller publishes a new routing table (a decision changed something).",
    )
    g.panel(
        "Admission limits per pool",
        [
            (f"max by (pool) (pdscope_pool_max_inflight_requests{{{P}}})", "max requests {{pool}}"),
        ],
        width=8,
    )
    g.panel(
        "Controller tick age",
        [("time() - max(pdscope_controller_last_success_timestamp_seconds)", "age")],
        unit="s",
        width=8,
        thresholds=[("green", None), ("orange", 10), ("red", 30)],
    )
    g.panel(
        "Proxy routing state",
        [("max by (state) (pdscope_proxy_routing_state)", "{{state}}")],
        kind="stat",
        width=8,
        instant=True,
        description="fresh: the controller's table; static/fallback: the controller is unreachable.",
    )
    g.panel(
        "Routing table age",
        [("max(pdscope_proxy_routing_table_age_seconds)", "age")],
        unit="s",
        width=8,
        thresholds=[("green", None), ("orange", 10), ("red", 60)],
    )
    g.panel(
        "Proxy requests/s by outcome",
        [
            (f"sum by (outcome) (rate(pdscope_proxy_requests_total[{RI}]))", "{{outcome}}"),
        ],
        unit="reqps",
        width=8,
    )
    g.panel(
        "Proxy admission rejections (429)",
        [
            (
                f"sum by (pool, reason) (rate(pdscope_proxy_rejections_total{{{P}}}[{RI}]))",
                "{{pool}} {{reason}}",
            ),
        ],
        unit="reqps",
        width=8,
    )
    g.panel(
        "Handoff in flight",
        [
            (f"sum by (pool) (pdscope_proxy_pool_inflight_requests{{{P}}})", "requests {{pool}}"),
        ],
        width=8,
    )
    g.panel(
        "Handoff KV bytes in flight",
        [
            (f"sum by (pool) (pdscope_proxy_pool_inflight_kv_bytes{{{P}}})", "{{pool}}"),
        ],
        unit="bytes",
        width=8,
    )
    g.panel(
        "In flight vs the limit, all proxies",
        [
            (f"sum by (pool) (pdscope_proxy_pool_inflight_requests{{{P}}})", "in flight {{pool}}"),
            (
                f'sum by (pool) (pdscope_proxy_pool_limit{{kind="requests",{P}}})',
                "slots held by the proxies {{pool}}",
            ),
        ],
        width=12,
        description="Each proxy enforces its part of a pool's limit (GET /v1/proxies): the parts add up "
        "to the pool's limit, so the fleet's in-flight stays under it however many proxies run.",
    )
    g.panel(
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
        kind="stat",
        width=12,
        instant=True,
        description="Leaders must be exactly 1; a proxy without a part admits limit / expected_replicas.",
    )
    g.panel(
        "Retries by stage",
        [
            (f"sum by (stage) (rate(pdscope_proxy_retries_total[{RI}]))", "{{stage}}"),
            (f"sum by (stage) (rate(pdscope_proxy_retries_refused_total[{RI}]))", "refused {{stage}}"),
        ],
        unit="ops",
        width=12,
    )
    g.panel(
        "pdscope services up",
        [('up{job=~"pdscope-.*"}', "{{job}}")],
        kind="stat",
        width=12,
        instant=True,
        thresholds=[("red", None), ("green", 1)],
    )
    g.panel(
        "Collector: targets up",
        [
            (f"max by (instance) (pdscope_collector_target_up{{{PI}}})", "{{instance}}"),
        ],
        kind="stat",
        width=12,
        instant=True,
        thresholds=[("red", None), ("green", 1)],
    )
    g.panel(
        "Collector: scrape duration",
        [
            (
                'max by (instance) (pdscope_collector_scrape_duration_seconds{instance=~"$instance"})',
                "{{instance}}",
            ),
        ],
        unit="s",
        width=12,
    )

    g.row("Capacity")
    g.panel(
        "Instances up by role, P:D ratio",
        [
            ('sum by (role) (up{job="vllm"})', "{{role}}"),
            ('count(up{job="vllm",role="prefill"} == 1) / count(up{job="vllm",role="decode"} == 1)', "P:D"),
        ],
        kind="stat",
        width=6,
        instant=True,
        description="Compare P:D with (decode capacity / prefill capacity) x (E[prompt] / E[output]).",
    )
    g.panel(
        "Prompt / output tokens per request",
        [
            (
                f'sum(rate(vllm:request_prompt_tokens_sum{{role="decode",{P}}}[{RI}]))'
                f' / sum(rate(vllm:request_generation_tokens_sum{{role="decode",{P}}}[{RI}]))',
                "E[prompt] / E[output]",
            ),
        ],
        width=6,
        description="The token mix that sets the P:D ratio a fleet needs (see the capacity page).",
    )
    g.panel(
        "Prefill tokens/s per prefill instance",
        [
            (
                f'sum(rate(vllm:prompt_tokens_by_source_total{{role="prefill",source="local_compute",{P}}}[{RI}]))'
                ' / count(up{job="vllm",role="prefill"} == 1)',
                "per P",
            ),
        ],
        width=6,
    )
    g.panel(
        "Generated tokens/s per decode instance",
        [
            (
                f'sum(rate(vllm:generation_tokens_total{{role="decode",{P}}}[{RI}]))'
                ' / count(up{job="vllm",role="decode"} == 1)',
                "per D",
            ),
        ],
        width=6,
    )
    g.panel(
        "Busiest KV cache per pool",
        [(f"max by (pool) (vllm:kv_cache_usage_perc{{{P}}})", "{{pool}}")],
        unit="percentunit",
        width=12,
    )
    g.panel(
        "Queue time p99 per pool",
        [
            (
                (
                    "histogram_quantile(0.99, sum by (pool, le) "
                    f"(rate(vllm:request_queue_time_seconds_bucket{{{P}}}[{RI}])))"
                ),
                "{{pool}}",
            ),
        ],
        unit="s",
        width=12,
        description="On decode, queue time includes the KV pull.",
    )

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


def _prefix_cache(g: _Layout) -> None:
    """vLLM's own prefix-cache hit rates, the proxy's KV-aware routes and predictions (proxy.kv_aware),
    and the health of its KV events streams and indexes (series per vLLM instance, no pool label)."""
    hits = "vllm:prefix_cache_hits_total"
    queries = "vllm:prefix_cache_queries_total"
    ext_hits = "vllm:external_prefix_cache_hits_total"
    ext_queries = "vllm:external_prefix_cache_queries_total"
    inst = 'instance=~"$instance"'
    g.panel(
        "Prefix cache hit rate (vLLM)",
        [
            (
                f"sum by (instance) (rate({hits}{{{PI}}}[5m]))"
                f" / sum by (instance) (rate({queries}{{{PI}}}[5m]))",
                "{{instance}}",
            ),
            (
                f'sum by (instance) (rate({ext_hits}{{role="decode",{PI}}}[5m]))'
                f' / sum by (instance) (rate({ext_queries}{{role="decode",{PI}}}[5m]))',
                "external {{instance}}",
            ),
        ],
        unit="percentunit",
        width=8,
        description="Share of queried prompt tokens found in the instance's own prefix cache; for D, "
        "external: the share found by its KV connector (pulled from P). A sudden fall: "
        "PrefixCacheHitRateCollapsed.",
    )
    g.panel(
        "Routes by path",
        [
            (f"sum by (path, reason) (rate(pdscope_proxy_routes_total[{RI}]))", "{{path}} {{reason}}"),
            (
                f'sum(rate(pdscope_proxy_routes_total{{path="decode_only"}}[{RI}]))'
                f" / sum(rate(pdscope_proxy_routes_total[{RI}]))",
                "share served without P",
            ),
        ],
        unit="ops",
        width=8,
        description="pd: P then D; decode_only: D alone computed the uncached part of the prompt "
        "(conditional disaggregation). The reason says why the router chose as it did.",
    )
    g.panel(
        "Predicted cached tokens vs vLLM's hits",
        [
            (
                f"sum by (role) (rate(pdscope_proxy_predicted_cached_tokens_total[{RI}]))",
                "predicted {{role}}",
            ),
            (f"sum by (role) (rate({hits}{{{P}}}[{RI}]))", "vLLM prefix hits {{role}}"),
            (f"sum(rate(pdscope_proxy_prompt_tokens_routed_total[{RI}]))", "prompt tokens routed"),
        ],
        unit="short",
        width=8,
        description="Tokens per second: what the router predicted the chosen P and D held, beside the "
        "prefix hits vLLM counted. Predictions well above the hits: the router's view lags the caches.",
    )
    g.panel(
        "KV events stream age",
        [
            (
                f"max by (instance) (pdscope_proxy_kv_events_last_message_age_seconds{{{inst}}})",
                "{{instance}}",
            ),
        ],
        unit="s",
        width=8,
        thresholds=[("green", None), ("red", 120)],
        description="Seconds since the proxy's last KV events message from the instance (the oldest over "
        "the proxies; -1: none since the proxy started). Over 120 s, or -1, while the instance serves: "
        "KVEventsStreamStale.",
    )
    g.panel(
        "KV index stale",
        [(f"max by (instance) (pdscope_proxy_kv_index_stale{{{inst}}})", "{{instance}}")],
        kind="stat",
        width=8,
        instant=True,
        thresholds=[("green", None), ("red", 1)],
        description="1: the proxy does not trust its index of the instance's cache (a gap not "
        "replayed, drops) and routes to it on load alone. For 5 minutes: KVIndexStale.",
    )
    g.panel(
        "KV events: messages, drops, gaps, replays",
        [
            (
                f"sum by (instance) (rate(pdscope_proxy_kv_events_messages_total{{{inst}}}[{RI}]))",
                "messages {{instance}}",
            ),
            (
                f"sum by (instance, reason) (rate(pdscope_proxy_kv_events_dropped_total{{{inst}}}[{RI}]))",
                "dropped {{reason}} {{instance}}",
            ),
            (
                f"sum by (instance) (rate(pdscope_proxy_kv_events_gaps_total{{{inst}}}[{RI}]))",
                "gaps {{instance}}",
            ),
            (
                f"sum by (instance, outcome) (rate(pdscope_proxy_kv_events_replays_total{{{inst}}}[{RI}]))",
                "replays {{outcome}} {{instance}}",
            ),
            (
                f"sum by (instance) (rate(pdscope_proxy_kv_events_restarts_total{{{inst}}}[{RI}]))",
                "publisher restarts {{instance}}",
            ),
        ],
        unit="ops",
        width=8,
    )


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(argv, __doc__, OUT, render, "deploy/grafana/build_dashboard.py")


if __name__ == "__main__":
    sys.exit(main())

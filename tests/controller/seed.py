"""Seed a store the way the collector writes it: cumulative snapshots and request records.

Used where a test needs exact, controllable signals (the end-to-end test uses the real
simulator and collector instead).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from pdscope.config import Settings, parse_config
from store.db import transaction
from store.models import RequestRecord, Snapshot

_ids = itertools.count(1)


def settings_yaml(
    store_url: str, n_p: int = 2, n_d: int = 4, extra: str = "", startup_s: float = 0.1
) -> Settings:
    """A seeded fleet's config. ``startup_s`` is short by default: tests of other behaviour act from the
    first tick; the start-up hold has its own tests (pass the window, 10, for the real default)."""
    p = "\n".join(f"      - {{name: prefill-{i}, url: 'http://127.0.0.1:{9100 + i}'}}" for i in range(n_p))
    d = "\n".join(f"      - {{name: decode-{i}, url: 'http://127.0.0.1:{9200 + i}'}}" for i in range(n_d))
    text = f"""
model: {{name: test-model, kv_bytes_per_token: 1000}}
pools:
  prefill:
    role: prefill
    instances:
{p}
  decode:
    role: decode
    instances:
{d}
slo:
  ttft: {{target_ms: 2000, percentile: 99}}
  tpot: {{target_ms: 100, percentile: 99}}
  window_s: 60
store: {{url: '{store_url}'}}
controller: {{interval_s: 2, window_s: 10, noise: {{startup_s: {startup_s}}}}}
collector: {{scrape_interval_s: 2, scrape_timeout_s: 1}}
{extra}
"""
    return parse_config(text, "test.yaml")


@dataclass
class Seeder:
    """Keeps per-instance cumulative counters so each scrape adds increments, like vLLM's."""

    factory: sessionmaker[Session]
    settings: Settings
    counters: dict[str, dict[str, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )

    def scrape(self, ts: float, **per_instance: dict[str, Any]) -> None:
        """One scrape of every instance. Per instance (name with '-' -> '_'): ``up`` (and a down
        scrape's ``error``: by default a timeout), gauges
        (``kv_cache_usage``...), and per-scrape increments ``transfers``, ``xfer_s`` (per
        transfer), ``failed``, ``expired``, ``ttft_n``, ``ttft_s``."""
        rows = []
        for pool, inst in self.settings.instances():
            role = self.settings.pools[pool].role
            spec = dict(per_instance.get(inst.name.replace("-", "_"), {}))
            up = spec.pop("up", True)
            error = spec.pop("error", "timeout after 0.4s")
            c = self.counters[inst.name]
            transfers = spec.pop("transfers", 10.0 if role == "decode" else 0.0)
            xfer_s = spec.pop("xfer_s", 0.01)
            c["nixl_xfer_time_count"] += transfers
            c["nixl_xfer_time_sum"] += transfers * xfer_s
            c["nixl_failed_transfers"] += spec.pop("failed", 0.0)
            c["nixl_kv_expired_reqs"] += spec.pop("expired", 0.0)
            n = spec.pop("ttft_n", 10.0)
            c["ttft_count"] += n
            c["ttft_sum"] += n * spec.pop("ttft_s", 0.2)
            c["requests_length"] += n
            c["queue_count"] += n
            c["queue_sum"] += n * spec.pop("queue_s", 0.02)
            values: dict[str, Any] = {"kv_cache_usage": 0.4, "num_running": 4.0, "num_waiting": 0.0}
            if role == "decode":
                values.update(
                    kv_fetch_waiting_to_start=0.0, kv_fetch_in_progress=1.0, kv_fetch_completed_waiting=0.0
                )
            values.update(spec)
            if up:
                rows.append(
                    Snapshot(instance=inst.name, pool=pool, role=role, ts=ts, up=True, **dict(c), **values)
                )
            else:
                rows.append(Snapshot(instance=inst.name, pool=pool, role=role, ts=ts, up=False, error=error))
        with transaction(self.factory) as s:
            s.add_all(rows)

    def requests(
        self,
        ts: float,
        pairs: list[tuple[str, str]],
        *,
        handoff_s: dict[str, float] | None = None,
        prefill_s: dict[str, float] | None = None,
        status: str = "ok",
        suspect: set[str] | None = None,
        tpot_s: float = 0.02,
        kv_bytes: int = 1_000_000,
        http_status: int | None = None,
        sender: str | None = None,
        queue_s: dict[str, float] | None = None,
        tenant: str | None = None,
        reject_reason: str | None = None,
    ) -> None:
        """One record per (P, D) pair, arriving at ``ts``, of ``tenant`` (rejected: for
        ``reject_reason``); handoff/prefill times per instance name;
        ``queue_s`` per P: the part of its prefill time spent in its queue (the span's time in queue; not
        recorded when absent); ``sender`` the OTLP sender the collector stored (None: sent without auth)."""
        handoff_s = handoff_s or {}
        prefill_s = prefill_s or {}
        rows = []
        for p, d in pairs:
            pre = prefill_s.get(p, 0.2)
            hand = handoff_s.get(d, 0.05)
            p_sent = ts + 0.001
            p_done = p_sent + pre
            d_sent = p_done + 0.001
            first = p_done + hand
            done = first + 0.5
            ttft = first - ts
            ok = status == "ok"
            met = ok and ttft <= 2.0 and tpot_s <= 0.1
            rows.append(
                RequestRecord(
                    request_id=f"r{next(_ids)}",
                    status=status,
                    p_instance=p,
                    d_instance=d,
                    p_pool="prefill",
                    d_pool="decode",
                    proxy_in=ts,
                    p_sent=p_sent,
                    p_done=p_done,
                    d_sent=d_sent,
                    first_token=first if ok else None,
                    done=done,
                    ttft_s=ttft if ok else None,
                    tpot_s=tpot_s if ok else None,
                    e2e_s=done - ts,
                    slo_ttft_met=ok and ttft <= 2.0,
                    slo_tpot_met=ok and tpot_s <= 0.1,
                    slo_met=met,
                    kv_bytes=kv_bytes,
                    prompt_tokens=1000,
                    completion_tokens=26,
                    lease_expiry_suspect=bool(suspect and d in suspect),
                    http_status=http_status,
                    sender=sender,
                    p_queue_s=(queue_s or {}).get(p),
                    tenant=tenant,
                    attributes={"reject_reason": reject_reason} if reject_reason else {},
                )
            )
        with transaction(self.factory) as s:
            s.add_all(rows)


def all_pairs(n_p: int = 2, n_d: int = 4) -> list[tuple[str, str]]:
    return [(f"prefill-{i}", f"decode-{j}") for i in range(n_p) for j in range(n_d)]

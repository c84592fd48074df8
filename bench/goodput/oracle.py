"""A fixed routing table served like the controller's ``GET /v1/routing`` (the oracle contender).

The oracle is what a perfect controller could reach: weights and admission limits set by
hand for the fault from its first second. It runs in a thread of the benchmark's worker
process. ``oracle_schedule`` holds the hand-set table of every fault (one entry per change:
the table from the start, and for a fault that ends, the table once it has ended).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.goodput.catalogue import HEALTHY, FaultPlan, FleetShape


class StaticTable:
    """Serves whatever :meth:`set` last stored, with ``ETag`` = its version."""

    def __init__(self) -> None:
        holder: dict[str, bytes] = {"body": b"{}", "etag": b'"0"'}
        self._holder = holder

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/v1/routing":
                    self.send_response(404)
                    self.end_headers()
                    return
                body, etag = holder["body"], holder["etag"].decode()
                if self.headers.get("If-None-Match") == etag:
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="oracle-table", daemon=True)

    def set(self, table: dict[str, Any]) -> None:
        self._holder["body"] = json.dumps(table).encode()
        self._holder["etag"] = f'"{table["version"]}"'.encode()

    def __enter__(self) -> StaticTable:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def oracle_table(
    instances: list[tuple[str, str, str, str]],
    weights: dict[str, float],
    limits: dict[str, int | None],
    wait_s: float | None = None,
    version: int = 1,
) -> dict[str, Any]:
    """``instances``: (name, pool, role, url); ``limits``: pool -> max in-flight requests;
    ``wait_s``: the longest wait for an admission slot where a pool has a limit."""
    return {
        "version": version,
        "generated_at": 0.0,
        "mode": "enforce",
        "enforce": True,
        "instances": [
            {
                "name": n,
                "pool": p,
                "role": r,
                "url": u,
                "weight": weights.get(n, 1.0),
                "drained": False,
                "reason": "Oracle",
            }
            for n, p, r, u in instances
        ],
        "pools": [
            {
                "name": pool,
                "role": pool,
                "weight": 1.0,
                "max_inflight_requests": lim,
                "max_inflight_kv_bytes": None,
                "max_queue_wait_s": None if lim is None else wait_s,
                "reason": "Oracle",
            }
            for pool, lim in limits.items()
        ],
    }


ORACLE_WAIT_S = 0.5  # hand-set: the TTFT target (2 s) minus the healthy fleet's p99 TTFT at capacity (~1.5 s)

Weights = dict[str, float]
Limits = dict[str, int | None]


def oracle_schedule(
    plan: FaultPlan, fleet: FleetShape, capacity_rps: float
) -> list[tuple[float | None, Weights, Limits]]:
    """The hand-set tables for ``plan``: ``(at, weights, limits)``, ``at`` in seconds after the fault's
    onset (None: from the start of the run). Decode has slack on these fleets (prefill is the
    bottleneck), so a D that is broken in any way gets no work; a slow P gets work by its speed and the
    prefill pool one second of the degraded fleet's capacity in flight; a burst meets a prefill limit of
    one second of capacity. ``capacity_rps`` is the healthy fleet's, measured in the same run."""
    none: Limits = {"prefill": None, "decode": None}
    d = fleet.bad_d
    if plan.name in ("degraded_decode_link", "transfer_failures", "stuck_decode", "kv_capacity"):
        # kv_capacity: at 10 % the D still holds ~12 of these sequences, but a D at the edge of its
        # blocks preempts; the other Ds have room for its share.
        return [(None, {d: 0.0}, none)]
    if plan.name == "bad_pair":
        return [(None, {d: 0.0}, none)]  # the pair's D: cheaper to lose than its P (decode has slack)
    if plan.name == "decode_down":
        return [(None, {d: 0.0}, none), (plan.ends_after_s, {}, none)]
    if plan.name in ("p_nic", "p_failing", "p_kv"):
        # every handoff late, a third failing, or prefills waiting on the KV leases hold: no work for that P
        return [(None, {fleet.bad_p: 0.0}, _p_limit(capacity_rps, (fleet.n_p - 1) / fleet.n_p))]
    if plan.name == "slow_prefill":
        speed = 1 / 3
        share = (fleet.n_p - 1 + speed) / fleet.n_p
        return [
            (None, {fleet.bad_p: speed}, {"prefill": max(2, round(capacity_rps * share)), "decode": None})
        ]
    if plan.name == "burst":
        return [(None, {}, {"prefill": max(2, round(capacity_rps)), "decode": None})]
    if plan.name == HEALTHY:
        return [(None, {}, none)]
    return _overload_schedule(plan, fleet, capacity_rps)


def _p_limit(capacity_rps: float, share: float = 1.0) -> Limits:
    """One second of the (remaining) capacity in flight on prefill, nothing on decode."""
    return {"prefill": max(2, round(capacity_rps * share)), "decode": None}


def _overload_schedule(
    plan: FaultPlan, fleet: FleetShape, capacity_rps: float
) -> list[tuple[float | None, Weights, Limits]]:
    """What an expert sets for the overload faults, from the fault's first second: no work for a
    dead instance, a slow P weighted by its speed, and the prefill pool held to one second of what
    the fleet can still prefill (``capacity_rps`` is the healthy fleet's for the cell's mix)."""
    p, d = fleet.bad_p, fleet.bad_d
    if plan.name in ("surge", "prefill_heavy"):
        return [(None, {}, _p_limit(capacity_rps))]
    if plan.name == "p_down":
        return [(None, {p: 0.0}, _p_limit(capacity_rps, (fleet.n_p - 1) / fleet.n_p))]
    if plan.name == "d_lost":
        # P is the bottleneck of these mixes: the other Ds have the compute and KV for its share, so
        # the dead D gets no work and no limit is cut
        return [(None, {d: 0.0}, {"prefill": None, "decode": None})]
    if plan.name == "degrade":
        # a step's table is set at the step (the first from the start: the P's first slowdown is known)
        out: list[tuple[float | None, Weights, Limits]] = []
        factor = 1.0
        for step in plan.injections:  # the simulator multiplies a P's active slowdowns
            at, factor = float(step.get("at", 0.0)), factor * float(step["factor"])
            share = (fleet.n_p - 1 + 1 / factor) / fleet.n_p
            out.append((None if at == 0 else at, {p: round(1 / factor, 4)}, _p_limit(capacity_rps, share)))
        return out
    raise ValueError(f"no oracle table for fault {plan.name!r}")

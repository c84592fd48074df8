"""Prefix caching in the engine on a virtual clock: hits shorten prefill, D pulls only what it lacks,
metrics and events follow, and the oracle (``cached_prefix_tokens``) tells the truth."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdscope.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, Event
from pdscope.simconfig import SimulatorConfig
from simulator.engine import Engine, drive
from simulator.fabric import Fabric
from simulator.faults import FaultSet, FaultSpec
from simulator.metrics import VllmMetrics
from simulator.model import RemoteKV, SimRequest, Transfer

KV = 327680
BS = 16
CFG = SimulatorConfig(
    prefill_tokens_per_s=10000,
    step_overhead_s=0.01,
    decode_per_seq_s=0.0,
    block_size=BS,
    link_bandwidth_bytes_per_s=1e9,
    per_descriptor_s=0.0,
    post_time_s=0.001,
)


class Observer(VllmMetrics):
    """The real metrics registry, plus a record of the transfers."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        super().__init__("m", cfg, KV)
        self.transfers: list[Transfer] = []

    def transfer_done(self, t: Transfer) -> None:
        super().transfer_done(t)
        self.transfers.append(t)

    def value(self, name: str, **labels: str) -> float:
        text = self.render(
            {
                "running": 0,
                "waiting_capacity": 0,
                "waiting_deferred": 0,
                "kv_cache_usage": 0,
                **dict.fromkeys(("waiting_to_start", "in_progress", "completed_waiting"), 0.0),
            }
        ).decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        raise KeyError(name)


def engine(name: str, role: str, cfg: SimulatorConfig, fabric: Fabric, faults: FaultSet) -> Engine:
    obs = Observer(cfg)
    eng = Engine(
        name, role, cfg, engine_id=name, kv_bytes_per_token=KV, fabric=fabric, faults=faults, observer=obs
    )
    events: list[Event] = []
    eng.on_events = events.extend
    eng.events = events  # type: ignore[attr-defined]
    return eng


def pair(cfg: SimulatorConfig = CFG) -> tuple[Engine, Engine, FaultSet]:
    faults = FaultSet()
    fabric = Fabric(cfg, faults, KV, seed=0)
    p = engine("P", "prefill", cfg, fabric, faults)
    d = engine("D", "decode", cfg, fabric, faults)
    fabric.register(p)
    return p, d, faults


def obs(e: Engine) -> Observer:
    assert isinstance(e.observer, Observer)
    return e.observer


def events(e: Engine) -> list[Event]:
    out: list[Event] = e.events  # type: ignore[attr-defined]
    return out


_n = iter(range(10**6))


def request(
    ids: Sequence[int], *, out: int = 1, remote: RemoteKV | None = None, p_side: bool = False
) -> SimRequest:
    i = next(_n)
    return SimRequest(
        f"cmpl-r{i}-0",
        f"cmpl-r{i}-0-{i:08x}",
        len(ids),
        out,
        0.0,
        params_max_tokens=out,
        do_remote_decode=p_side,
        remote=remote,
        token_ids=tuple(ids),
    )


def serve(e: Engine, req: SimRequest, now: float) -> float:
    e.submit(req, now)
    end = drive(e, until=now + 5.0, now=now)
    assert req.finished
    return end


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def ttft(req: SimRequest) -> float:
    assert req.first_token_ts is not None and req.scheduled_ts is not None
    return req.first_token_ts - req.scheduled_ts


def test_a_repeated_prompt_hits_and_prefills_only_the_rest() -> None:
    p, _, _ = pair()
    first, second = request(prompt(1600)), request(prompt(1600))
    now = serve(p, first, 0.0)
    assert p.cached_prefix_tokens(prompt(1600)) == 1584  # all but the last block: one token to compute
    now = serve(p, second, now + 1.0)
    assert (first.local_cached_tokens, second.local_cached_tokens) == (0, 1584)
    assert ttft(first) == pytest.approx(0.01 + 1600 / 10000)
    assert ttft(second) == pytest.approx(0.01 + 16 / 10000)  # only the last block is computed
    m = obs(p)
    assert m.value("vllm:prefix_cache_queries_total") == 3200
    assert m.value("vllm:prefix_cache_hits_total") == 1584
    assert m.value("vllm:prompt_tokens_cached_total") == 1584
    assert m.value("vllm:prompt_tokens_cached_by_source_total", source="device") == 1584
    assert m.value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 1584
    assert m.value("vllm:prompt_tokens_by_source_total", source="local_compute") == 1600 + 16
    assert m.value("vllm:request_prefill_kv_computed_tokens_sum") == 1600 + 16


def test_a_shared_prefix_hits_partially() -> None:
    p, _, _ = pair()
    system = prompt(320)
    now = serve(p, request(system + prompt(40, start=5)), 0.0)
    other = request(system + prompt(40, start=9000))
    serve(p, other, now)
    assert other.local_cached_tokens == 320  # the shared 20 blocks, not the diverging tail


def test_caching_off_keeps_the_old_model() -> None:
    cfg = CFG.model_copy(update={"prefix_caching": False})
    p, _, _ = pair(cfg)
    first, second = request(prompt(1600)), request(prompt(1600))
    now = serve(p, first, 0.0)
    serve(p, second, now)
    assert second.local_cached_tokens == 0 and ttft(second) == pytest.approx(ttft(first))
    assert p.cached_prefix_tokens(prompt(1600)) == 0 and events(p) == []


def test_a_cache_too_small_for_two_prompts_stops_hitting() -> None:
    a, b = prompt(1600), prompt(1600, start=50000)  # 100 blocks each

    def hits(capacity: int) -> list[int]:
        p, _, _ = pair(CFG.model_copy(update={"kv_capacity_blocks": capacity}))
        now = 0.0
        out = []
        for ids in (a, b, a, b):
            req = request(ids)
            now = serve(p, req, now)
            out.append(req.local_cached_tokens)
        if capacity < 200:
            assert any(isinstance(e, BlockRemoved) for e in events(p))
        return out

    assert hits(400) == [0, 0, 1584, 1584]
    # 120 blocks: each prompt evicts the other's chain tail first (freed last block first), so
    # only the first 20 blocks of each survive to be hit
    assert hits(120) == [0, 0, 320, 320]


def test_a_capacity_cut_evicts_cached_blocks() -> None:
    p, _, faults = pair()
    now = serve(p, request(prompt(1600)), 0.0)
    assert p.cached_prefix_tokens(prompt(1600)) == 1584
    faults.add(FaultSpec(kind="kv_capacity", instance="P", blocks=10), 1)
    drive(p, until=now + 0.1, now=now)
    p.begin_step(now + 0.1)  # a step applies the cut
    assert p.pool.active + p.pool.cached_free <= 10
    assert p.cached_prefix_tokens(prompt(1600)) <= 10 * BS


def test_events_follow_the_cache() -> None:
    p, _, _ = pair()
    ids = prompt(40)
    serve(p, request(ids), 0.0)
    stored = [e for e in events(p) if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids] == ids[:32]  # the two full blocks, in order
    assert stored[0].parent is None and all(e.block_size == BS and e.medium == "GPU" for e in stored)
    p.crash(10.0)
    p.flush_events()
    assert events(p)[-1] == AllBlocksCleared() and p.cached_prefix_tokens(ids) == 0


def p_then_d(p: Engine, d: Engine, ids: list[int], now: float) -> tuple[SimRequest, float]:
    pr = request(ids, p_side=True)
    now = serve(p, pr, now)
    remote = RemoteKV("P", pr.internal_id, pr.leased_block_ids, "localhost", 5600, len(ids))
    dr = request(ids, out=3, remote=remote)
    d.submit(dr, now)
    t_p = t_d = now
    for _ in range(5000):
        if dr.finished:
            break
        now += 0.001
        t_p = drive(p, now, t_p)
        t_d = drive(d, now, t_d)
    assert dr.finish_reason == "length"
    return dr, now


def test_d_pulls_only_the_blocks_it_lacks() -> None:
    p, d, _ = pair()
    system = prompt(320)  # 20 blocks
    first, now = p_then_d(p, d, system + prompt(40, start=7), 0.0)
    second, now = p_then_d(p, d, system + prompt(40, start=9000), now)
    t1, t2 = obs(d).transfers
    assert t1.nbytes == 23 * BS * KV  # ceil(360 / 16): all of it
    assert second.local_cached_tokens == 320 and t2.nbytes == 3 * BS * KV  # only past the shared prefix
    assert (first.external_tokens, second.external_tokens) == (360, 40)
    assert (first.cached_tokens, second.cached_tokens) == (360, 360)
    m = obs(d)
    assert m.value("vllm:prefix_cache_hits_total") == 320
    assert m.value("vllm:external_prefix_cache_hits_total") == 400
    assert m.value("vllm:prompt_tokens_cached_by_source_total", source="p2p") == 400
    assert m.value("vllm:prompt_tokens_cached_by_source_total", source="device") == 320
    assert p.used_blocks == 0 and d.used_blocks == 0  # leases released, D finished
    # D caches what it received (BlockStored after the pull), so the whole prompt now hits on D
    assert d.cached_prefix_tokens(system + prompt(40, start=7)) == 352


def test_p_side_hits_are_reported_on_p() -> None:
    p, d, _ = pair()
    ids = prompt(200)
    _, now = p_then_d(p, d, ids, 0.0)
    pr = request(ids, p_side=True)
    serve(p, pr, now)
    assert pr.local_cached_tokens == 192 and pr.cached_tokens == 192

"""The engine model on a virtual clock: batching, KV blocks, pulls, leases, faults."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from pdscope.simconfig import SimulatorConfig
from simulator.engine import Engine, drive
from simulator.fabric import Fabric
from simulator.faults import FaultSet, FaultSpec
from simulator.model import RemoteKV, SimRequest, Transfer

KV = 327680


class Rec:
    """Records every observer call."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.transfers: list[Transfer] = []
        self.itl: list[float] = []

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any) -> None:
            self.calls[name] += 1
            if name == "transfer_done":
                self.transfers.append(args[0])
            if name == "inter_token":
                self.itl.append(args[0])

        return record


def make(cfg: SimulatorConfig, faults: FaultSet | None = None) -> tuple[Engine, Engine, Rec, Rec, Fabric]:
    faults = faults or FaultSet()
    fabric = Fabric(cfg, faults, KV, seed=cfg.seed)
    rp, rd = Rec(), Rec()
    p = Engine(
        "prefill-0",
        "prefill",
        cfg,
        engine_id="P",
        kv_bytes_per_token=KV,
        fabric=fabric,
        faults=faults,
        observer=rp,
    )
    d = Engine(
        "decode-0",
        "decode",
        cfg,
        engine_id="D",
        kv_bytes_per_token=KV,
        fabric=fabric,
        faults=faults,
        observer=rd,
    )
    fabric.register(p)
    return p, d, rp, rd, fabric


def p_request(i: int, prompt: int, now: float = 0.0) -> SimRequest:
    return SimRequest(
        f"cmpl-r{i}-0", f"cmpl-r{i}-0-0000000{i}", prompt, 1, now, params_max_tokens=1, do_remote_decode=True
    )


def d_request(p_req: SimRequest, out: int, now: float) -> SimRequest:
    remote = RemoteKV("P", p_req.internal_id, p_req.leased_block_ids, "localhost", 5600, p_req.prompt_tokens)
    return SimRequest(
        p_req.request_id,
        p_req.internal_id[:-8] + "ffffffff",
        p_req.prompt_tokens,
        out,
        now,
        params_max_tokens=out,
        remote=remote,
    )


def run_both(p: Engine, d: Engine, until: float, now: float = 0.0, dt: float = 0.001) -> float:
    """Advance two engines together in small virtual-time slices."""
    t_p = t_d = now
    while now < until:
        now += dt
        t_p = drive(p, now, t_p)
        t_d = drive(d, now, t_d)
    return now


def test_prefill_time_follows_rate_and_blocks_are_leased_until_expiry() -> None:
    cfg = SimulatorConfig(
        prefill_tokens_per_s=10000, step_overhead_s=0.01, decode_per_seq_s=0.0, block_size=16
    )
    p, _, rp, _, _ = make(cfg)
    req = p_request(1, 1600)
    p.submit(req, 0.0)
    drive(p, until=1.0)
    assert req.finish_reason == "length"
    assert req.first_token_ts == pytest.approx(0.01 + 1600 / 10000)
    assert len(req.leased_block_ids) == 100 and p.used_blocks == 100  # held for D
    drive(p, until=29.0, now=1.0)
    assert p.used_blocks == 100 and rp.calls["kv_expired"] == 0
    drive(p, until=31.0, now=29.0)
    assert p.used_blocks == 0 and rp.calls["kv_expired"] == 1


def test_pull_transfers_kv_frees_p_blocks_and_counts_on_d() -> None:
    cfg = SimulatorConfig(
        link_bandwidth_bytes_per_s=1e9, per_descriptor_s=1e-4, descriptors_per_block=2, post_time_s=0.001
    )
    p, d, rp, rd, _ = make(cfg)
    pr = p_request(1, 160)
    p.submit(pr, 0.0)
    now = drive(p, until=0.5)
    dr = d_request(pr, 5, now)
    d.submit(dr, now)
    run_both(p, d, until=now + 1.0, now=now)
    assert dr.finish_reason == "length" and dr.generated == 5
    assert p.used_blocks == 0 and d.used_blocks == 0
    assert rd.calls["transfer_done"] == 1 and rp.calls["transfer_done"] == 0
    (t,) = rd.transfers
    assert t.nbytes == 10 * 16 * KV and t.descriptors == 20
    assert t.xfer_s == pytest.approx(t.nbytes / 1e9 + 20 * 1e-4)
    assert dr.external_tokens == 160  # the prompt came over NIXL, only one token recomputed
    assert rp.calls["kv_expired"] == 0 and rp.calls["notification_after_expiry"] == 0


def test_slow_link_multiplies_transfer_time_and_links_queue() -> None:
    cfg = SimulatorConfig(link_bandwidth_bytes_per_s=1e9, per_descriptor_s=0.0, post_time_s=0.0)
    faults = FaultSet()
    p, _d, _, _rd, fabric = make(cfg, faults)
    remote = RemoteKV("P", "x", (), "localhost", 5600)
    p.leases["x"] = type("L", (), {"blocks": [], "expiry": 100.0})()  # a leased request to read
    base = fabric.start_pull("decode-0", remote, 10, now=0.0)
    queued = fabric.start_pull("decode-0", remote, 10, now=0.0)  # same link: waits for the first read
    assert queued.done_at == pytest.approx(2 * base.done_at)
    faults.add(FaultSpec(kind="slow_link", prefill="prefill-0", decode="decode-0", factor=10))
    slow = fabric.start_pull("decode-0", remote, 10, now=10.0)
    assert slow.xfer_s == pytest.approx(10 * base.xfer_s)
    faults.add(FaultSpec(kind="slow_nic", decode="decode-0", factor=2))
    slower = fabric.start_pull("decode-0", remote, 10, now=20.0)
    assert slower.xfer_s == pytest.approx(20 * base.xfer_s)


def test_decode_step_time_grows_with_batch() -> None:
    cfg = SimulatorConfig(step_overhead_s=0.01, decode_per_seq_s=0.001)

    def mean_itl(batch: int) -> float:
        eng = Engine("d", "decode", cfg, engine_id="D", kv_bytes_per_token=KV, observer=(rec := Rec()))
        for i in range(batch):
            eng.submit(SimRequest(f"r{i}", f"r{i}-x", 16, 20, 0.0), 0.0)
        drive(eng, until=10.0)
        return sum(rec.itl) / len(rec.itl)

    assert mean_itl(1) == pytest.approx(0.011)
    assert mean_itl(64) == pytest.approx(0.01 + 64 * 0.001)


def test_d_admits_only_with_free_blocks_and_preempts_when_full() -> None:
    cfg = SimulatorConfig(kv_capacity_blocks=10, block_size=16)
    eng = Engine("d", "decode", cfg, engine_id="D", kv_bytes_per_token=KV, observer=(rec := Rec()))
    a = SimRequest("a", "a-x", 100, 40, 0.0)  # 7 blocks for the prompt, grows to 9
    b = SimRequest("b", "b-x", 48, 40, 0.0)  # 3 blocks
    eng.submit(a, 0.0)
    eng.submit(b, 0.0)
    eng.advance(0.0)
    eng.begin_step(0.0)
    assert eng.used_blocks == 10 and len(eng.running) == 2
    drive(eng, until=30.0, now=0.0)
    assert a.finish_reason == "length" and b.finish_reason == "length"
    assert rec.calls["preempted"] >= 1 and eng.used_blocks == 0


def test_capacity_fault_blocks_admission_and_heartbeats_keep_the_lease() -> None:
    cfg = SimulatorConfig(lease_duration_s=30.0)
    faults = FaultSet()
    p, d, rp, rd, _ = make(cfg, faults)
    pr = p_request(1, 320)
    p.submit(pr, 0.0)
    now = drive(p, until=0.5)
    fid = faults.add(FaultSpec(kind="kv_capacity", instance="decode-0", blocks=5))  # 20 blocks needed
    dr = d_request(pr, 4, now)
    d.submit(dr, now)
    now = run_both(p, d, until=90.0, now=now, dt=0.5)
    assert dr.kv_stage == "waiting_to_start" and not dr.finished
    assert rp.calls["kv_expired"] == 0  # D's heartbeats extended P's lease for 90 s
    faults.remove(fid)
    run_both(p, d, until=now + 2.0, now=now, dt=0.01)
    assert dr.finish_reason == "length" and rd.calls["transfer_done"] == 1


def test_stop_pulling_lets_p_leases_expire_then_the_late_pull_is_a_notification_after_expiry() -> None:
    cfg = SimulatorConfig(lease_duration_s=6.0)
    faults = FaultSet()
    p, d, rp, rd, _ = make(cfg, faults)
    pr = p_request(1, 64)
    p.submit(pr, 0.0)
    now = drive(p, until=0.5)
    fid = faults.add(FaultSpec(kind="stop_pulling", decode="decode-0"))
    dr = d_request(pr, 4, now)
    d.submit(dr, now)
    now = run_both(p, d, until=10.0, now=now, dt=0.1)
    assert rp.calls["kv_expired"] == 1 and p.used_blocks == 0
    assert d.gauges()["waiting_to_start"] == 1
    faults.remove(fid)
    run_both(p, d, until=now + 1.0, now=now, dt=0.01)
    # as real vLLM 0.32: D reads the freed (not yet reused) blocks, P counts the late "done"
    assert (
        dr.finish_reason == "length" and rd.calls["transfer_done"] == 1 and rd.calls["transfer_failed"] == 0
    )
    assert rp.calls["notification_after_expiry"] == 1


def test_a_stalled_lease_reaper_strands_p_blocks_until_the_fault_clears() -> None:
    cfg = SimulatorConfig(lease_duration_s=2.0)
    faults = FaultSet()
    p, _d, rp, _, _ = make(cfg, faults)
    fid = faults.add(FaultSpec(kind="lease_stall", instance="prefill-0"))
    p.submit(pr := p_request(1, 64), 0.0)
    now = drive(p, until=30.0)  # no D ever pulls; the lease ran out long ago
    assert pr.finished and not p.running and not p.waiting
    assert p.used_blocks == 4 and rp.calls["kv_expired"] == 0 and p.kv_cache_usage > 0
    assert p.next_timer() is None  # nothing to wake for while the reaper is stalled
    faults.remove(fid)
    drive(p, until=now + 0.1, now=now)
    assert p.used_blocks == 0 and rp.calls["kv_expired"] == 1  # the reaper catches up


def test_transfer_failure_rate_is_seeded_and_reproducible() -> None:
    def failures(seed: int) -> list[bool]:
        cfg = SimulatorConfig(seed=seed)
        faults = FaultSet()
        faults.add(FaultSpec(kind="transfer_failure", rate=0.5))
        p, _, _, _, fabric = make(cfg, faults)
        p.leases["x"] = type("L", (), {"blocks": [], "expiry": 100.0})()
        remote = RemoteKV("P", "x", (), "localhost", 5600)
        return [fabric.start_pull("decode-0", remote, 1, float(i)).ok for i in range(50)]

    assert failures(1) == failures(1)
    assert failures(1) != failures(2)
    assert 10 < sum(failures(1)) < 40


def test_transfer_to_unknown_engine_fails_and_abort_frees_blocks() -> None:
    cfg = SimulatorConfig()
    _p, d, _, rd, _ = make(cfg)
    ghost = SimRequest("g", "g-x", 64, 4, 0.0, remote=RemoteKV("nope", "r", (1,), "h", 1))
    d.submit(ghost, 0.0)
    drive(d, until=1.0)
    assert ghost.finish_reason == "error" and rd.calls["transfer_failed"] == 1 and d.used_blocks == 0
    slow = SimRequest("s", "s-x", 64, 1000, 1.0)
    d.submit(slow, 1.0)
    drive(d, until=1.5, now=1.0)
    assert d.used_blocks > 0
    d.abort(slow, 1.5)
    assert slow.finish_reason == "abort" and d.used_blocks == 0


def test_invalid_kv_transfer_params_fall_back_to_local_prefill() -> None:
    assert RemoteKV.from_params({"do_remote_prefill": True, "remote_engine_id": "e"}) is None
    assert RemoteKV.from_params({"do_remote_decode": True}) is None
    full = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_block_ids": [[1, 2], [3]],
        "remote_host": "h",
        "remote_port": 5600,
        "tp_size": 1,
    }
    remote = RemoteKV.from_params(full)
    assert remote is not None and remote.block_ids == (1, 2, 3)


def test_slow_fault_and_latency_scale_change_step_time() -> None:
    faults = FaultSet()
    faults.add(FaultSpec(kind="slow", instance="prefill-0", factor=5))
    for scale, expected in ((1.0, 5 * 0.0101), (0.0, 0.0)):
        cfg = SimulatorConfig(
            latency_scale=scale, step_overhead_s=0.01, prefill_tokens_per_s=10000, decode_per_seq_s=0.0
        )
        p, _, _, _, _ = make(cfg, faults)
        req = p_request(1, 1)
        p.submit(req, 0.0)
        drive(p, until=1.0)
        assert req.first_token_ts == pytest.approx(expected)


def test_per_instance_overrides_are_validated_and_applied() -> None:
    from pdscope.config import ConfigError
    from simulator.config import parse_simulator_config

    cfg = parse_simulator_config(
        {"kv_capacity_blocks": 100, "instances": {"decode-1": {"kv_capacity_blocks": 7}}}
    )
    assert cfg.for_instance("decode-1").kv_capacity_blocks == 7
    assert cfg.for_instance("decode-0").kv_capacity_blocks == 100
    with pytest.raises(ConfigError, match="seed cannot be set per instance"):
        parse_simulator_config({"instances": {"decode-1": {"seed": 3}}})
    with pytest.raises(ConfigError, match="kv_capacity_blocks"):
        parse_simulator_config({"instances": {"decode-1": {"kv_capacity_blocks": -1}}})
    with pytest.raises(ConfigError, match=r"simulator\.latency_scale"):
        parse_simulator_config({"latency_scale": -1})


def test_fault_specs_validate_per_kind() -> None:
    from pdscope.config import ConfigError
    from simulator.faults import parse_fault

    assert parse_fault({"kind": "slow_nic", "instance": "decode-0", "factor": 3}).decode == "decode-0"
    assert parse_fault({"kind": "stop_pulling", "instance": "decode-1"}).decode == "decode-1"
    for bad in (
        {"kind": "slow_link", "prefill": "p"},
        {"kind": "kv_capacity", "instance": "p"},
        {"kind": "transfer_failure", "rate": 2},
        {"kind": "nope"},
        {"kind": "down"},
        {"kind": "slow", "instance": "p", "factor": 2, "extra": 1},
        {"kind": "slow_nic", "factor": 2},  # whose NIC?
        {"kind": "slow_nic", "prefill": "p", "decode": "d", "factor": 2},  # a link is slow_link
    ):
        with pytest.raises(ConfigError):
            parse_fault(bad)


def test_a_ps_nic_slows_every_link_out_of_that_p_and_no_other() -> None:
    """Issue 29's P-side fault: a P's network slow toward every D (a D's slow NIC is its column)."""
    faults = FaultSet()
    faults.add(FaultSpec(kind="slow_nic", prefill="prefill-1", factor=10))
    assert [faults.link_factor("prefill-1", d) for d in ("decode-0", "decode-3")] == [10, 10]
    assert faults.link_factor("prefill-0", "decode-0") == 1
    faults.add(FaultSpec(kind="slow_nic", decode="decode-0", factor=2))
    assert faults.link_factor("prefill-1", "decode-0") == 20
    assert faults.link_factor("prefill-0", "decode-0") == 2
    assert faults.link_factor("prefill-0", "decode-1") == 1

"""Push mode on a virtual clock: D registers its blocks, P writes into them and records the write."""

from __future__ import annotations

import pytest

from pdscope.simconfig import SimulatorConfig
from simulator.faults import FaultSet, FaultSpec
from simulator.model import RemoteKV, SimRequest
from tests.simulator.test_engine import KV, make, p_request, run_both


def push_cfg(**kw: object) -> SimulatorConfig:
    return SimulatorConfig(
        transfer_mode="push",
        link_bandwidth_bytes_per_s=1e9,
        per_descriptor_s=1e-4,
        post_time_s=0.001,
        **kw,  # type: ignore[arg-type]
    )


def push_d_request(i: int, prompt: int, out: int, now: float, engine_id: str = "P") -> SimRequest:
    """D's request as the proxy sends it before P answered: P's coordinates, no block or request id."""
    remote = RemoteKV.from_params(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_request_id": f"cmpl-r{i}-0",  # P's internal id is not known yet: a placeholder
            "remote_host": "localhost",
            "remote_port": 5600,
            "tp_size": 1,
        },
        "push",
    )
    return SimRequest(
        f"cmpl-r{i}-0", f"cmpl-r{i}-0-ffffffff", prompt, out, now, params_max_tokens=out, remote=remote
    )


@pytest.mark.parametrize("d_first", [True, False])
def test_push_writes_when_both_halves_are_there_and_p_records_it(d_first: bool) -> None:
    p, d, rp, rd, _ = make(push_cfg())
    pr, dr = p_request(1, 160), push_d_request(1, 160, 5, 0.0)
    if d_first:  # the proxy sent both legs at once: D registers before P finished
        d.submit(dr, 0.0)
        p.submit(pr, 0.0)
    else:
        p.submit(pr, 0.0)
        run_both(p, d, until=0.5)
        d.submit(dr, 0.5)
    run_both(p, d, until=2.0, now=0.0 if d_first else 0.5)
    assert pr.finish_reason == "length" and dr.finish_reason == "length" and dr.generated == 5
    assert rp.calls["transfer_done"] == 1 and rd.calls["transfer_done"] == 0  # P records in push mode
    (t,) = rp.transfers
    assert t.nbytes == 10 * 16 * KV
    assert p.used_blocks == 0 and d.used_blocks == 0  # the write freed P's blocks
    assert dr.external_tokens == 160
    assert rp.calls["kv_expired"] == 0 and rd.calls["transfer_failed"] == 0
    if d_first:  # the write started as P finished: D's first token soon after P's
        assert dr.first_token_ts is not None and pr.first_token_ts is not None
        assert dr.first_token_ts - pr.first_token_ts < 0.05


def test_registration_to_an_unknown_engine_fails_at_once_on_d() -> None:
    """A D registering with an engine id P no longer has (P restarted) fails its request, counted on D."""
    p, d, rp, rd, _ = make(push_cfg())
    dr = push_d_request(1, 160, 5, 0.0, engine_id="P-before-restart")
    d.submit(dr, 0.0)
    run_both(p, d, until=0.5)
    assert dr.finish_reason == "error"
    assert rd.calls["transfer_failed"] == 1 and rp.calls["transfer_failed"] == 0


def test_registration_whose_p_never_finishes_times_out() -> None:
    p, d, _, rd, _ = make(push_cfg(push_registration_timeout_s=5.0))
    dr = push_d_request(1, 160, 5, 0.0)
    d.submit(dr, 0.0)  # P never gets the request
    run_both(p, d, until=4.0, dt=0.01)
    assert dr.finish_reason is None and d.used_blocks == 10  # D's blocks wait for P's write
    run_both(p, d, until=6.0, now=4.0, dt=0.01)
    assert dr.finish_reason == "error" and d.used_blocks == 0 and rd.calls["transfer_failed"] == 1


def test_a_failing_link_fails_the_write_on_p() -> None:
    faults = FaultSet()
    faults.add(FaultSpec(kind="transfer_failure", prefill="prefill-0", decode="decode-0", rate=1.0))
    p, d, rp, rd, _ = make(push_cfg(), faults)
    pr, dr = p_request(1, 160), push_d_request(1, 160, 5, 0.0)
    d.submit(dr, 0.0)
    p.submit(pr, 0.0)
    run_both(p, d, until=1.0)
    assert dr.finish_reason == "error"
    assert rp.calls["transfer_failed"] == 1 and rd.calls["transfer_failed"] == 0
    assert p.used_blocks == 0  # a failed write frees P's blocks too


def test_unregistered_p_blocks_expire_and_are_forgotten() -> None:
    p, d, rp, _, fabric = make(push_cfg(lease_duration_s=2.0))
    pr = p_request(1, 160)
    p.submit(pr, 0.0)
    run_both(p, d, until=3.0, dt=0.01)
    assert rp.calls["kv_expired"] == 1 and p.used_blocks == 0
    assert not fabric._push_done  # no D will register for it: nothing kept


def test_push_params_need_p_coordinates() -> None:
    assert RemoteKV.from_params({"do_remote_prefill": True, "remote_engine_id": "P"}, "push") is None
    coords = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h", "remote_port": 1}
    assert RemoteKV.from_params({**coords, "tp_size": 1}, "push") is None  # vLLM's D needs the request id
    assert RemoteKV.from_params({**coords, "tp_size": 1, "remote_request_id": "x"}, "push") is not None

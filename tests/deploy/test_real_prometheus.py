"""Debian's real Prometheus against a simulated P/D fleet and pdscope: scrape, record, alert, query.

Prometheus runs on a free loopback port with tmp storage, 1 s scrape and evaluation, and a
config generated from deploy/prometheus (the shipped relabelling, the shipped rules with
their `for:` durations shortened to 1 s so a test can see them fire). A simulated fleet
(1 P + 2 D, real vLLM metric names) runs behind pdscope's collector, controller and proxy
(subprocesses on a SQLite store). Traffic goes through the proxy and directly as P/D pairs;
then faults are injected and the matching alerts must fire through Prometheus's own API:
a decode instance that stops pulling (P's leases expire: KVLeaseExpired), failing NIXL
reads (NixlTransferFailures, PoolRequestErrors), a decode instance down (InstanceDown,
CollectorTargetDown) and the controller gone (ServiceDown,
ProxyRoutingStale). Every PromQL expression of the Grafana dashboard is evaluated
against it with the whole stack up. A second test checks the relabelling on target files.
Every wait is bounded; every process is stopped by PID (its process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.sockets import free_port, free_ports
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PROM_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "pdscope-dashboard.json"

pytestmark = [pytest.mark.promtool, pytest.mark.slow]


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)


# -- config generated from the shipped templates ------------------------------------------


def _host_port(url: str) -> str:
    return url.split("://", 1)[1].rstrip("/")


def write_prometheus_config(root: Path, fleet: Any, services: dict[str, str], scrape_s: str = "1s") -> Path:
    """deploy/prometheus with this test's targets, short intervals and `for:` shortened."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=scrape_s, evaluation_interval=scrape_s, scrape_timeout=scrape_s)
    (root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    rules = root / "rules"
    rules.mkdir()
    for path in sorted((PROM_DIR / "rules").glob("*.yml")):
        data = yaml.safe_load(path.read_text())
        for group in data["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    rule["for"] = "1s"
        (rules / path.name).write_text(yaml.safe_dump(data, sort_keys=False))
    targets = root / "targets"
    targets.mkdir()
    by_role: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    for role, name, url in fleet.instances:
        by_role[role].append({"targets": [_host_port(url)], "labels": {"instance": name}})
    # prefill: the file says its pool; decode: pool and role come from the file name alone
    for group in by_role["prefill"]:
        group["labels"]["pool"] = "prefill"
    (targets / "vllm-prefill.yml").write_text(yaml.safe_dump(by_role["prefill"]))
    (targets / "vllm-decode.yml").write_text(yaml.safe_dump(by_role["decode"]))
    for service, url in services.items():
        (targets / f"pdscope-{service}.yml").write_text(
            yaml.safe_dump([{"targets": [_host_port(url)], "labels": {"instance": service}}])
        )
    return root / "prometheus.yml"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=5.0)

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = self.http.get("/api/v1/query", params={"query": expr})
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing(self, alertname: str, **labels: str) -> list[dict[str, Any]]:
        alerts = self.http.get("/api/v1/alerts").json()["data"]["alerts"]
        return [
            a
            for a in alerts
            if a["labels"]["alertname"] == alertname
            and a["state"] == "firing"
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip(
            "promtool tier skipped: the prometheus server is not installed (apt-get install prometheus)"
        )
    return path


@pytest.fixture
def fleet() -> Iterator[Any]:
    from simulator.testing import running_fleet

    # latency_scale 0.05: a 2k-token prefill takes ~6 ms; leases of 1 s expire quickly
    with running_fleet(n_prefill=1, n_decode=2, seed=3, latency_scale=0.05, lease_duration_s=1.0) as f:
        yield f


class Stack:
    """pdscope's collector, controller and proxy as subprocesses in front of the fleet."""

    def __init__(self, root: Path, fleet: Any) -> None:
        self.root = root
        self.ports = dict(zip(("collect", "control", "proxy"), free_ports(3), strict=True))
        self.config = root / "pdscope.yaml"
        self.config.write_text(
            fleet.config_yaml(
                store={"url": f"sqlite:///{root / 'store.db'}"},
                collector={
                    "host": "127.0.0.1",
                    "port": self.ports["collect"],
                    "scrape_interval_s": 1,
                    "scrape_timeout_s": 0.5,
                    "spool_dir": str(root / "collector-spool"),
                },
                controller={"host": "127.0.0.1", "port": self.ports["control"], "interval_s": 1},
                proxy={"host": "127.0.0.1", "port": self.ports["proxy"]},  # spans to the collector
            )
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def url(self, cmd: str) -> str:
        return f"http://127.0.0.1:{self.ports[cmd]}"

    def _pdscope(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pdscope.cli", "--config", str(self.config), *args]

    def start(self) -> None:
        up = subprocess.run(
            self._pdscope("db", "upgrade"), cwd=REPO, capture_output=True, text=True, timeout=120, check=False
        )
        assert up.returncode == 0, up.stderr[-2000:]
        for cmd in ("collect", "control", "proxy"):
            log = (self.root / f"{cmd}.log").open("wb")
            self.procs[cmd] = subprocess.Popen(
                self._pdscope(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            log.close()
        for cmd in self.procs:
            wait_until(
                f"pdscope {cmd}'s /metrics", lambda cmd=cmd: self._serving(cmd), timeout_s=45, every_s=0.5
            )

    def _serving(self, cmd: str) -> bool:
        if self.procs[cmd].poll() is not None:
            raise AssertionError(f"pdscope {cmd} exited: {(self.root / f'{cmd}.log').read_text()[-2000:]}")
        try:
            return httpx.get(f"{self.url(cmd)}/metrics", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, cmd: str) -> None:
        _stop(self.procs[cmd])

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs.values())):  # the proxy first, the collector last
            _stop(proc)


@pytest.fixture
def stack(fleet: Any, tmp_path: Path) -> Iterator[Stack]:
    root = tmp_path / "pdscope"
    root.mkdir()
    s = Stack(root, fleet)
    try:
        s.start()
        yield s
    finally:
        s.stop_all()


@contextlib.contextmanager
def running_prometheus(binary: str, root: Path, config: Path) -> Iterator[Prometheus]:
    """Prometheus on a free loopback port with storage under ``root``; stopped by PID."""
    port = free_port()
    log = (root / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(root / 'prometheus.log').read_text()[-2000:]}")
            try:
                return httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until("Prometheus to be ready", ready, timeout_s=30, every_s=0.5)
        prom = Prometheus(url)
        try:
            yield prom
        finally:
            prom.http.close()
    finally:
        _stop(proc)
        log.close()


@pytest.fixture
def prometheus(prometheus_binary: str, fleet: Any, stack: Stack, tmp_path: Path) -> Iterator[Prometheus]:
    root = tmp_path / "prom"
    root.mkdir()
    config = write_prometheus_config(
        root,
        fleet,
        {
            "proxy": stack.url("proxy"),
            "collector": stack.url("collect"),
            "controller": stack.url("control"),
        },
    )
    with running_prometheus(prometheus_binary, root, config) as prom:
        yield prom


def test_relabelling_takes_pool_and_role_from_target_files(prometheus_binary: str, tmp_path: Path) -> None:
    """The shipped vllm job: labels in a target file win; else role and pool come from the file
    name (vllm-<role>[-<pool>].yml); a vLLM target without a valid role is dropped."""
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config.pop("rule_files")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    targets = tmp_path / "targets"
    targets.mkdir()
    # nothing listens on these ports: the targets are down, their labels are what is checked
    files = {
        "vllm-prefill.yml": [{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"instance": "p0"}}],
        "vllm-decode-fast.yml": [{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"instance": "d0"}}],
        "vllm-decode-slow.yml": [
            {
                "targets": [f"127.0.0.1:{free_port()}"],
                "labels": {"instance": "d1", "pool": "h200", "role": "decode"},
            }
        ],
        "vllm-misc.yml": [{"targets": [f"127.0.0.1:{free_port()}"], "labels": {"instance": "x0"}}],
    }
    for name, groups in files.items():
        (targets / name).write_text(yaml.safe_dump(groups))
    with running_prometheus(prometheus_binary, tmp_path, tmp_path / "prometheus.yml") as prom:

        def discovered() -> dict[str, Any] | None:
            data: dict[str, Any] = prom.http.get("/api/v1/targets").json()["data"]
            return data if len(data["activeTargets"]) == 3 and data["droppedTargets"] else None

        data = wait_until("3 active and 1 dropped vLLM targets", discovered, timeout_s=30, every_s=0.5)
    labels = {
        t["labels"]["instance"]: (t["labels"]["pool"], t["labels"]["role"]) for t in data["activeTargets"]
    }
    assert labels == {"p0": ("prefill", "prefill"), "d0": ("fast", "decode"), "d1": ("h200", "decode")}
    dropped = [t["discoveredLabels"] for t in data["droppedTargets"]]
    assert [d["instance"] for d in dropped] == ["x0"]


# -- traffic -----------------------------------------------------------------------------


def pd_request(client: httpx.Client, model: str, p_url: str, d_url: str, prompt_words: int = 600) -> int:
    """One request the way vLLM's toy proxy does it: P with max_tokens=1, then D with P's
    kv_transfer_params. Returns D's status (or 0 if D did not answer in time)."""
    prompt = " ".join(["tok"] * prompt_words)
    p = client.post(
        f"{p_url}/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
    )
    p.raise_for_status()
    kv = p.json()["kv_transfer_params"]
    assert kv and kv["do_remote_prefill"] is True
    try:
        d = client.post(
            f"{d_url}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "kv_transfer_params": kv,
            },
        )
    except httpx.TimeoutException:
        return 0
    return d.status_code


def via_proxy(client: httpx.Client, proxy_url: str, model: str, n: int) -> list[str]:
    """Send ``n`` requests through pdscope's proxy; return the failures as 'status body'."""
    failures = []
    for _ in range(n):
        r = client.post(
            f"{proxy_url}/v1/completions",
            json={"model": model, "prompt": " ".join(["tok"] * 400), "max_tokens": 8},
        )
        if r.status_code != 200:
            failures.append(f"{r.status_code} {r.text[:300]}")
    return failures


# -- the test ----------------------------------------------------------------------------


def test_rules_fire_on_a_simulated_fleet_and_dashboard_queries_evaluate(
    fleet: Any, stack: Stack, prometheus: Prometheus, request: pytest.FixtureRequest
) -> None:
    model = fleet.model_name
    (p_url,) = fleet.prefill_urls
    d0_url, d1_url = fleet.decode_urls
    client = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0))
    request.addfinalizer(client.close)

    # 1. targets carry pool/role/instance from the file_sd relabelling; pdscope's jobs are up
    def targets_up() -> list[dict[str, Any]] | None:
        result = prometheus.query('up{job="vllm"} == 1')
        return result if len(result) == 3 else None

    up = wait_until("3 vLLM targets up", targets_up, timeout_s=30, every_s=0.5)
    labels = {r["metric"]["instance"]: (r["metric"]["pool"], r["metric"]["role"]) for r in up}
    assert labels == {
        "prefill-0": ("prefill", "prefill"),
        "decode-0": ("decode", "decode"),
        "decode-1": ("decode", "decode"),
    }
    wait_until(
        "pdscope's proxy, collector and controller up",
        lambda: len(prometheus.query('up{job=~"pdscope-.*"} == 1')) == 3,
        timeout_s=30,
        every_s=0.5,
    )
    # honor_labels: the collector's per-target series keep the vLLM instance names
    wait_until(
        "the collector's per-target up",
        lambda: (
            len(
                prometheus.query(
                    'pdscope_collector_target_up{job="pdscope-collector",'
                    'instance=~"prefill-0|decode-0|decode-1"} == 1'
                )
            )
            == 3
        ),
        timeout_s=30,
        every_s=0.5,
    )

    # 2. healthy traffic: through pdscope's proxy (following the controller), and direct P/D pairs
    wait_until(
        "the proxy on the controller's routing table",
        lambda: prometheus.query('pdscope_proxy_routing_state{state=~"fresh|advisory"} == 1'),
        timeout_s=30,
        every_s=0.5,
    )
    assert via_proxy(client, stack.url("proxy"), model, 12) == []
    for i in range(12):
        assert pd_request(client, model, p_url, (d0_url, d1_url)[i % 2]) == 200
    wait_until(
        "the proxy's requests in Prometheus",
        lambda: prometheus.query('sum(pdscope_proxy_requests_total{outcome="ok"}) >= 12'),
        timeout_s=30,
        every_s=0.5,
    )
    wait_until(
        "recorded finished-request rates for both pools",
        lambda: len(prometheus.query("pool_role:vllm_request_success:rate5m > 0")) == 2,
        timeout_s=30,
        every_s=0.5,
    )
    wait_until(
        "recorded NIXL transfer p99",
        lambda: prometheus.query('pool_role:vllm_nixl_xfer_time_seconds:p99_rate5m{role="decode"} > 0'),
        timeout_s=30,
        every_s=0.5,
    )
    # the proxy's spans became request records; the controller's SLO attainment comes from them
    wait_until(
        "the controller's SLO attainment",
        lambda: prometheus.query("pdscope_slo_attainment >= 0"),
        timeout_s=45,
        every_s=0.5,
    )
    for name in (
        "KVLeaseExpired",
        "NixlTransferFailures",
        "PoolRequestErrors",
        "InstanceDown",
        "ProxyRoutingStale",
        "ServiceDown",
        "CollectorTargetDown",
        "ControllerStale",
        "ProxyDown",
    ):
        assert prometheus.firing(name) == [], name
    expired_before = prometheus.query('sum(vllm:nixl_num_kv_expired_reqs_total{instance="prefill-0"})')
    assert float(expired_before[0]["value"][1]) == 0

    # 3. decode-0 stops pulling: prefill-0's leases (1 s) expire -> KVLeaseExpired on prefill-0
    fleet.inject({"kind": "stop_pulling", "decode": "decode-0"})
    with httpx.Client(timeout=httpx.Timeout(4.0, connect=2.0)) as stuck, ThreadPoolExecutor(3) as pool:
        statuses = list(pool.map(lambda _: pd_request(stuck, model, p_url, d0_url), range(3)))
    assert 200 not in statuses, statuses  # no decode completed without its KV
    alert = wait_until(
        "KVLeaseExpired firing for prefill-0",
        lambda: prometheus.firing("KVLeaseExpired", instance="prefill-0"),
        timeout_s=45,
        every_s=0.5,
    )
    assert (alert[0]["labels"]["severity"], alert[0]["labels"]["source"]) == ("warning", "prometheus")
    assert alert[0]["annotations"]["runbook_url"].endswith("RUNBOOK.md#kvleaseexpired")
    assert "KV lease expiries on prefill-0" in alert[0]["annotations"]["summary"]
    assert prometheus.firing("KVLeaseExpired", instance="decode-1") == []

    # 4. every NIXL read into decode-1 fails -> NixlTransferFailures on decode-1, and its requests
    #    finish with an error (vLLM's "fail" policy) -> PoolRequestErrors on the decode pool
    fid = fleet.inject({"kind": "transfer_failure", "rate": 1.0, "decode": "decode-1"})
    statuses = [pd_request(client, model, p_url, d1_url) for _ in range(4)]
    assert 200 not in statuses, statuses
    failing = wait_until(
        "NixlTransferFailures firing for decode-1",
        lambda: prometheus.firing("NixlTransferFailures"),
        timeout_s=45,
        every_s=0.5,
    )
    assert [a["labels"]["instance"] for a in failing] == ["decode-1"]
    assert failing[0]["labels"]["severity"] == "critical"
    errors = wait_until(
        "PoolRequestErrors firing for the decode pool",
        lambda: prometheus.firing("PoolRequestErrors"),
        timeout_s=45,
        every_s=0.5,
    )
    assert [(a["labels"]["pool"], a["labels"]["role"]) for a in errors] == [("decode", "decode")]
    assert fleet.remove_fault(fid)  # decode-0 still does not pull: it never fails a read

    # 5. decode-1 goes down -> InstanceDown (Prometheus) and CollectorTargetDown (pdscope)
    fleet.inject({"kind": "down", "instance": "decode-1"})
    down = wait_until(
        "InstanceDown firing for decode-1",
        lambda: prometheus.firing("InstanceDown"),
        timeout_s=45,
        every_s=0.5,
    )
    assert [a["labels"]["instance"] for a in down] == ["decode-1"]
    assert down[0]["labels"]["pool"] == "decode" and down[0]["labels"]["role"] == "decode"
    seen = wait_until(
        "CollectorTargetDown firing for decode-1",
        lambda: prometheus.firing("CollectorTargetDown"),
        timeout_s=45,
        every_s=0.5,
    )
    assert [a["labels"]["instance"] for a in seen] == ["decode-1"]
    assert prometheus.firing("PoolDown") == []  # decode-0 still answers scrapes

    # 6. every Grafana expression evaluates (a query error fails here); with the whole stack running,
    # they have data
    for expr in dashboard_expressions():
        prometheus.query(expr)
    # series that exist only after their event (a rejection, a retry, an admitted handoff, a KV
    # events message dropped or out of sequence, a replay, a publisher restart)
    event_only = (
        "rejections",
        "retries",
        "pool_inflight",
        "kv_events_dropped",
        "kv_events_gaps",
        "kv_events_replays",
        "kv_events_restarts",
    )
    # the proxy's KV-aware routing series need proxy.kv_aware and a kv_events_endpoint per instance,
    # which this stack does not configure (its proxy routes on load): they are evaluated (a query
    # error fails above), not required to have data
    event_only += KV_AWARE_SERIES
    must_have_data = [
        e
        for e in dashboard_expressions()
        if re.search(r"\bvllm:|pdscope_", e) and not any(name in e for name in event_only)
    ]
    assert len(must_have_data) >= 30
    # A scrape the loaded machine missed (its timeout is under the 1 s interval) marks that target's
    # series stale until its next one: the data is waited for over a few scrapes, not read at one instant.
    wait_until(
        "every dashboard query of the live fleet to have data",
        lambda: [e for e in must_have_data if not prometheus.query(e)],
        done=lambda missing: not missing,
        timeout_s=10,
        every_s=0.5,
    )

    # and the dashboard's variables list the fleet's pools and instances
    variables = dashboard_variable_values(prometheus)
    assert variables["pool"] == ["decode", "prefill"]
    assert {"prefill-0", "decode-0"} <= set(variables["instance"])

    # 7. the controller goes away: ServiceDown, and the proxy's routing goes stale
    stack.stop("control")
    gone = wait_until(
        "ServiceDown firing for the controller",
        lambda: prometheus.firing("ServiceDown", job="pdscope-controller"),
        timeout_s=45,
        every_s=0.5,
    )
    assert gone[0]["labels"]["severity"] == "warning"
    stale = wait_until(
        "ProxyRoutingStale firing for the proxy",
        lambda: prometheus.firing("ProxyRoutingStale", instance="proxy"),
        timeout_s=45,
        every_s=0.5,
    )
    assert stale[0]["labels"]["state"] in {"static", "fallback"}
    assert prometheus.firing("ProxyDown") == []


KV_AWARE_SERIES = (
    "pdscope_proxy_routes_total",
    "pdscope_proxy_predicted_cached_tokens_total",
    "pdscope_proxy_prompt_tokens_routed_total",
    "pdscope_proxy_kv_events_",
    "pdscope_proxy_kv_index_",
    "pdscope_proxy_kv_checked_cached_tokens_total",
    "pdscope_proxy_kv_hit_checks_total",
)


def dashboard_expressions() -> list[str]:
    """Every PromQL expression in the Grafana dashboard, with its variables set to 'all'."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in dash["annotations"]["list"] if "expr" in a]
    out = []
    for e in exprs:
        e = e.replace("$__rate_interval", "30s").replace('"$pool"', '".*"').replace('"$instance"', '".*"')
        assert "$" not in e, e
        out.append(e)
    return out


def dashboard_variable_values(prometheus: Prometheus) -> dict[str, list[str]]:
    """What Grafana's label_values(<selector>, <label>) variables resolve to on this Prometheus."""
    dash = json.loads(DASHBOARD.read_text())
    values: dict[str, list[str]] = {}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert found, var["query"]
        selector = found.group(1).replace('"$pool"', '".*"')
        r = prometheus.http.get(f"/api/v1/label/{found.group(2)}/values", params={"match[]": selector})
        assert r.status_code == 200, r.text
        values[var["name"]] = sorted(r.json()["data"])
    return values

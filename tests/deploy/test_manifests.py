"""deploy/compose, deploy/k8s, deploy/Dockerfile and deploy/grafana: checked without docker.

Schemas: the Compose spec (vendored in check-jsonschema) and Kubernetes 1.30 strict schemas
(kubernetes-validate). Structure: selectors match pod labels, Services select workloads and
name ports the pods have, volumes and ConfigMap keys exist, images are pinned, pdscope
containers run pdscope commands with a config that validates and points at services that
exist, vLLM runs NixlConnector with the kv_role its pool's role needs. Generated files
(k8s ConfigMaps, the Grafana JSON) must be fresh.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

from pdscope.cli import COMMANDS
from pdscope.config import Settings, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"
K8S_VERSION = "1.30.0"
# Secrets the operator creates (documented in deploy/k8s/pdscope.yaml); never committed.
EXTERNAL_SECRETS = {
    "pdscope-secrets": {
        "api-token",
        "db-password",
        "hf-token",
        "otlp-proxy-token",
        "otlp-vllm-token",
        "proxy-secret",
    }
}
WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- every YAML parses -------------------------------------------------------------------


def test_every_yaml_file_in_deploy_parses() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yml", ".yaml")]
    assert len(files) >= 15
    for path in files:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(d is not None for d in docs), path


# -- Kubernetes --------------------------------------------------------------------------


def _k8s_docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for rel in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / rel).read_text()):
            doc["_file"] = rel
            docs.append(doc)
    return docs


def _clean(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def _by_kind(docs: list[dict[str, Any]], *kinds: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in kinds]


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _containers(workload: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = _pod_spec(workload)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def _configmaps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in _by_kind(docs, "ConfigMap")}


def test_kustomization_lists_every_manifest_and_nothing_missing() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert kustomization["namespace"] == "pdscope"


def test_k8s_manifests_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = _k8s_docs()
    assert len(docs) >= 25
    for doc in docs:
        kubernetes_validate.validate(_clean(doc), K8S_VERSION, strict=True)


@pytest.mark.canary
def test_k8s_schema_check_rejects_a_misspelt_field() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    doc = copy.deepcopy(_clean(_by_kind(_k8s_docs(), "StatefulSet")[0]))
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["containerPorts"] = container.pop("ports")
    with pytest.raises(jsonschema.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_every_object_is_in_the_pdscope_namespace_with_unique_names() -> None:
    seen: set[tuple[str, str]] = set()
    for doc in _k8s_docs():
        meta = doc["metadata"]
        if doc["kind"] != "Namespace":
            assert meta.get("namespace") == "pdscope", (doc["kind"], meta["name"])
        key = (doc["kind"], meta["name"])
        assert key not in seen, key
        seen.add(key)


def test_k8s_workload_selectors_match_their_pod_labels() -> None:
    for w in _by_kind(_k8s_docs(), "Deployment", "StatefulSet"):
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]


def test_k8s_services_select_pods_and_target_ports_they_have() -> None:
    docs = _k8s_docs()
    workloads = _by_kind(docs, *WORKLOADS)
    for svc in _by_kind(docs, "Service"):
        name = svc["metadata"]["name"]
        selector = svc["spec"]["selector"]
        selected = [
            w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected, f"Service {name} selects no workload"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in selected:
                ports = [p for c in _containers(w) for p in c.get("ports", [])]
                assert any(target in (p.get("name"), p["containerPort"]) for p in ports), (
                    f"Service {name} targets port {target!r}, which {w['metadata']['name']} does not expose"
                )


def test_k8s_statefulsets_have_their_governing_headless_service() -> None:
    docs = _k8s_docs()
    services = {s["metadata"]["name"]: s for s in _by_kind(docs, "Service")}
    for sts in _by_kind(docs, "StatefulSet"):
        svc = services.get(sts["spec"]["serviceName"])
        assert svc is not None, sts["metadata"]["name"]
        if sts["metadata"]["labels"].get("app.kubernetes.io/name") == "vllm":
            # per-pod DNS names (vllm-prefill-0.vllm-prefill) need a headless Service
            assert svc["spec"].get("clusterIP") == "None"


def test_k8s_volumes_mounts_configmaps_secrets_and_accounts_resolve() -> None:
    docs = _k8s_docs()
    configmaps = _configmaps(docs)
    accounts = {d["metadata"]["name"] for d in _by_kind(docs, "ServiceAccount")}
    claims = {d["metadata"]["name"] for d in _by_kind(docs, "PersistentVolumeClaim")}
    for w in _by_kind(docs, *WORKLOADS):
        spec = _pod_spec(w)
        name = w["metadata"]["name"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        if "serviceAccountName" in spec:
            assert spec["serviceAccountName"] in accounts, name
        for vol in volumes.values():
            if "configMap" in vol:
                cm = vol["configMap"]["name"]
                assert cm in configmaps, f"{name}: ConfigMap {cm} does not exist"
                for item in vol["configMap"].get("items", []):
                    assert item["key"] in configmaps[cm], f"{name}: {cm} has no key {item['key']}"
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in claims, name
        for c in _containers(w):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{name}: {mount['name']}"
                if "subPath" in mount:
                    cm = volumes[mount["name"]]["configMap"]["name"]
                    assert mount["subPath"] in configmaps[cm], f"{name}: {cm} has no key {mount['subPath']}"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in EXTERNAL_SECRETS.get(ref["name"], set()), f"{name}: {ref}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if port is not None:
                    assert port in {p.get("name") for p in c["ports"]} | {
                        p["containerPort"] for p in c["ports"]
                    }


def test_k8s_images_are_pinned() -> None:
    for w in _by_kind(_k8s_docs(), *WORKLOADS):
        for c in _containers(w):
            image = c["image"]
            assert ":" in image and not image.endswith(":latest"), image


def test_k8s_pdscope_containers_run_pdscope_commands_on_the_mounted_config() -> None:
    docs = _k8s_docs()
    config_text = _configmaps(docs)["pdscope-config"]["pdscope.yaml"]
    settings = parse_config(config_text, "pdscope-config")
    found = set()
    for w in _by_kind(docs, *WORKLOADS):
        for c in _containers(w):
            if not c["image"].startswith("pdscope:"):
                continue
            args = c["args"]
            assert args[:2] == ["--config", "/etc/pdscope/pdscope.yaml"], args
            assert args[2] in COMMANDS, args
            found.add(args[2])
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/etc/pdscope" in mounts
            ports = {p["containerPort"] for p in c.get("ports", [])}
            expected = {
                "proxy": settings.proxy.port,
                "collect": settings.collector.port,
                "control": settings.controller.port,
                "dashboard": settings.dashboard.port,
            }.get(args[2])
            if expected is not None:
                assert expected in ports, (args[2], ports)
    assert {"proxy", "collect", "control", "dashboard", "db"} <= found
    # a server in a pod must listen beyond loopback to be reachable through its Service
    for section in (settings.proxy, settings.collector, settings.controller, settings.dashboard):
        assert section.host == "0.0.0.0"


def _dns_names(docs: list[dict[str, Any]]) -> set[str]:
    names = {s["metadata"]["name"] for s in _by_kind(docs, "Service")}
    for sts in _by_kind(docs, "StatefulSet"):
        for i in range(sts["spec"]["replicas"]):
            names.add(f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}")
    return names


def test_k8s_pdscope_config_points_at_pods_and_services_that_exist() -> None:
    docs = _k8s_docs()
    settings = parse_config(_configmaps(docs)["pdscope-config"]["pdscope.yaml"], "pdscope-config")
    names = _dns_names(docs)
    urls = [inst.url for _, inst in settings.instances()]
    urls += [settings.controller_url, *settings.controller_urls, settings.proxy.otlp_endpoint or ""]
    for url in urls:
        assert urlparse(url).hostname in names, url
    assert urlparse(settings.store.url).hostname in names
    # every vLLM pod the StatefulSets create is a pdscope instance of the pool its labels name
    for sts in _by_kind(docs, "StatefulSet"):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") != "vllm":
            continue
        pool = settings.pools[labels["pdscope.io/pool"]]
        assert pool.role == labels["pdscope.io/role"]
        assert [i.name for i in pool.instances] == [
            f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])
        ]


def _vllm_checks(args: list[str], env: dict[str, str], ports: set[int], role: str, gpu: bool) -> None:
    assert gpu, "vLLM must request a GPU"
    kv = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
    assert len(kv) == 1, args
    kv_config = json.loads(kv[0])
    assert kv_config["kv_connector"] == "NixlConnector"
    assert kv_config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    assert "--port=8000" in args and 8000 in ports
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) in ports
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert any(a.startswith("--otlp-traces-endpoint=http://pdscope-collector:4318/") for a in args)


def test_k8s_vllm_runs_on_gpus_with_nixl_and_a_reachable_side_channel() -> None:
    pools = 0
    for sts in _by_kind(_k8s_docs(), "StatefulSet"):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/name") != "vllm":
            continue
        pools += 1
        (c,) = _pod_spec(sts)["containers"]
        env = {e["name"]: e.get("value", "") for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"  # not localhost: D pulls across pods
        _vllm_checks(
            c["args"],
            env,
            {p["containerPort"] for p in c["ports"]},
            labels["pdscope.io/role"],
            gpu=c["resources"]["limits"].get("nvidia.com/gpu") == "1",
        )
    assert pools == 2


def test_k8s_prometheus_discovers_vllm_pods_by_the_labels_they_carry() -> None:
    docs = _k8s_docs()
    prom = yaml.safe_load(_configmaps(docs)["prometheus-config"]["prometheus.yml"])
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "vllm"]
    sources = {s for r in job["relabel_configs"] for s in r.get("source_labels", [])}
    pod_labels = set()
    for sts in _by_kind(docs, "StatefulSet"):
        for key in sts["spec"]["template"]["metadata"]["labels"]:
            pod_labels.add("__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key))
    used = {s for s in sources if s.startswith("__meta_kubernetes_pod_label_")}
    assert used and used <= pod_labels
    targets = {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}
    assert {"pool", "role", "instance"} <= targets
    # the same pdscope jobs and rules as deploy/prometheus/prometheus.yml
    base = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert [j["job_name"] for j in prom["scrape_configs"]] == [j["job_name"] for j in base["scrape_configs"]]
    assert prom["rule_files"] == base["rule_files"]


@pytest.mark.promtool
def test_k8s_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """Debian's promtool is built without Kubernetes discovery, so the kubernetes_sd_configs
    blocks are swapped for a static target; everything else (relabelling, rules) is checked."""
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool tier skipped: promtool is not installed (apt-get install prometheus)")
    prom = yaml.safe_load(_configmaps(_k8s_docs())["prometheus-config"]["prometheus.yml"])
    for job in prom["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["vllm-prefill-0.vllm-prefill:8000"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
    rules = tmp_path / "rules"
    rules.mkdir()
    for key, text in _configmaps(_k8s_docs())["prometheus-rules"].items():
        (rules / key).write_text(text)
    out = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_k8s_generated_configmaps_are_fresh() -> None:
    render = _load("render_configmaps", K8S / "render_configmaps.py")
    assert (K8S / "generated-configmaps.yaml").read_text() == render.render(), (
        "deploy/k8s/generated-configmaps.yaml is stale: run python deploy/k8s/render_configmaps.py"
    )
    # and it carries the very files promtool and the Grafana checks look at
    cms = _configmaps(_k8s_docs())
    for path in sorted((DEPLOY / "prometheus" / "rules").glob("*.yml")):
        assert cms["prometheus-rules"][path.name] == path.read_text()
    assert (
        cms["grafana-dashboards"]["pdscope-dashboard.json"]
        == (DEPLOY / "grafana" / "pdscope-dashboard.json").read_text()
    )


# -- Compose -----------------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    return data


def _compose_schema() -> dict[str, Any]:
    pytest.importorskip("check_jsonschema")
    from importlib.resources import files

    text = files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def test_compose_file_validates_against_the_compose_spec() -> None:
    jsonschema.validate(_compose(), _compose_schema())


@pytest.mark.canary
def test_compose_schema_check_rejects_a_wrong_field() -> None:
    schema = _compose_schema()
    broken = copy.deepcopy(_compose())
    broken["services"]["pdscope-proxy"]["portz"] = broken["services"]["pdscope-proxy"].pop("ports")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_compose_references_resolve() -> None:
    compose = _compose()
    services = compose["services"]
    named_volumes = set(compose.get("volumes", {}))
    published: list[str] = []
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in named_volumes, f"{name}: volume {source} is not declared"
        if "build" in svc:
            context = COMPOSE / svc["build"]["context"]
            assert (context / svc["build"]["dockerfile"]).is_file()
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
            published.append(port.split(":")[1])
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), image
    assert len(published) == len(set(published)), "two services publish the same host port"


def _compose_settings() -> Settings:
    return load_config(COMPOSE / "pdscope.yaml")


def test_compose_pdscope_services_run_pdscope_commands_on_a_valid_config() -> None:
    services = _compose()["services"]
    settings = _compose_settings()
    ports = {
        "proxy": settings.proxy.port,
        "collect": settings.collector.port,
        "control": settings.controller.port,
        "dashboard": settings.dashboard.port,
    }
    found = set()
    for name, svc in services.items():
        if not svc["image"].startswith("pdscope:"):
            continue
        cmd = svc["command"]
        assert cmd[:2] == ["--config", "/etc/pdscope/pdscope.yaml"] and cmd[2] in COMMANDS, cmd
        found.add(cmd[2])
        assert "./pdscope.yaml:/etc/pdscope/pdscope.yaml:ro" in svc["volumes"]
        if cmd[2] in ports:
            # each replica publishes its server's port on a host port of its own (127.0.0.1 only)
            (published,) = svc["ports"]
            assert published.startswith("127.0.0.1:") and published.endswith(f":{ports[cmd[2]]}"), name
    assert {"proxy", "collect", "control", "dashboard", "db"} <= found
    # inside its container a server listens on every interface; the host publishes loopback only
    for section in (settings.proxy, settings.collector, settings.controller, settings.dashboard):
        assert section.host == "0.0.0.0"


def _compose_aliases(services: dict[str, Any]) -> dict[str, set[str]]:
    """Network alias -> the services that carry it (Docker's DNS answers it with all of them)."""
    aliases: dict[str, set[str]] = {}
    for name, svc in services.items():
        for net in (svc.get("networks") or {}).values():
            for alias in (net or {}).get("aliases", []):
                aliases.setdefault(alias, set()).add(name)
    return aliases


def test_compose_pdscope_config_points_at_compose_services() -> None:
    services = _compose()["services"]
    names = set(services) | set(_compose_aliases(services))
    settings = _compose_settings()
    urls = [inst.url for _, inst in settings.instances()]
    urls += [settings.controller_url, *settings.controller_urls, settings.proxy.otlp_endpoint or ""]
    urls.append(settings.store.url)
    for url in urls:
        assert urlparse(url).hostname in names, url
    # and each pdscope instance name is the vLLM service that serves it
    for pool_name, inst in settings.instances():
        assert inst.name in services
        role = settings.pools[pool_name].role
        svc = services[inst.name]
        env = {k: str(v) for k, v in svc["environment"].items()}
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == inst.name
        assert env["OTEL_SERVICE_NAME"] == inst.name
        exposed = {int(p) for p in svc["expose"]}
        gpu = any(
            "gpu" in d.get("capabilities", []) for d in svc["deploy"]["resources"]["reservations"]["devices"]
        )
        _vllm_checks(svc["command"], env, exposed, role, gpu)


def test_compose_prometheus_targets_are_compose_services_with_pdscope_names() -> None:
    services = _compose()["services"]
    settings = _compose_settings()
    instances = {inst.name: pool for pool, inst in settings.instances()}
    seen = set()
    for path in sorted((COMPOSE / "prometheus-targets").glob("*.yml")):
        for group in yaml.safe_load(path.read_text()):
            for target in group["targets"]:
                host, _port = target.rsplit(":", 1)
                assert host in services, target
                if path.name.startswith("vllm-"):
                    assert group["labels"]["instance"] == host
                    role = path.stem.split("-")[1]
                    assert settings.pools[instances[host]].role == role
                    seen.add(host)
    assert seen == set(instances)


# -- fleet scale: replicas, PostgreSQL, probes, scraping every replica ------------------------

# The replica counts the deployments run (issue 16): what each buys is in docs/deploy.md.
FLEET = {"proxy": 3, "control": 2, "collect": 2}
K8S_WORKLOAD = {"proxy": "pdscope-proxy", "control": "pdscope-controller", "collect": "pdscope-collector"}


def _k8s_settings(docs: list[dict[str, Any]]) -> Settings:
    return parse_config(_configmaps(docs)["pdscope-config"]["pdscope.yaml"], "pdscope-config")


def _deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _by_kind(docs, "Deployment")}


def _command_of(workload: dict[str, Any]) -> str | None:
    for c in _pod_spec(workload)["containers"]:
        if c["image"].startswith("pdscope:"):
            return str(c["args"][2])
    return None


def test_k8s_runs_3_proxies_2_controllers_and_2_collectors() -> None:
    docs = _k8s_docs()
    deployments = _deployments(docs)
    for command, replicas in FLEET.items():
        w = deployments[K8S_WORKLOAD[command]]
        assert _command_of(w) == command
        assert w["spec"]["replicas"] == replicas, (command, w["spec"]["replicas"])
        # a rollout never drops below the count: a new pod first, then an old one goes
        assert w["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # no other workload runs one of these commands (a stray single-replica copy would not count)
    for w in _by_kind(docs, *WORKLOADS):
        if _command_of(w) in FLEET:
            assert w["metadata"]["name"] == K8S_WORKLOAD[str(_command_of(w))]


def test_k8s_disruption_budgets_keep_all_but_one_replica() -> None:
    docs = _k8s_docs()
    deployments = _deployments(docs)
    pdbs = _by_kind(docs, "PodDisruptionBudget")
    for command, replicas in FLEET.items():
        w = deployments[K8S_WORKLOAD[command]]
        labels = w["spec"]["template"]["metadata"]["labels"]
        (pdb,) = [p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        spec = pdb["spec"]
        # maxUnavailable 1, or the minAvailable that leaves the same
        assert spec.get("maxUnavailable", replicas - spec.get("minAvailable", 0)) == 1, pdb["metadata"]
        assert replicas >= 2  # a budget of one unavailable over one replica would block every drain


def _workers(args: list[str]) -> int:
    """`pdscope proxy --workers N` runs N proxies in one container (default 1)."""
    for i, arg in enumerate(args):
        if arg == "--workers":
            return int(args[i + 1])
        if arg.startswith("--workers="):
            return int(arg.split("=", 1)[1])
    return 1


def test_k8s_proxy_expected_replicas_is_the_proxy_deployments_replicas() -> None:
    """proxy.expected_replicas counts proxy processes: pods x workers."""
    docs = _k8s_docs()
    proxy = _deployments(docs)["pdscope-proxy"]
    (c,) = _pod_spec(proxy)["containers"]
    processes = proxy["spec"]["replicas"] * _workers(c["args"])
    assert _k8s_settings(docs).proxy.expected_replicas == processes


def _pdscope_configs() -> Iterator[tuple[str, str]]:
    """(where, text) of every pdscope config under deploy/: the files that are one, and the
    ConfigMap the k8s pods mount."""
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        data = docs[0] if len(docs) == 1 else None
        if isinstance(data, dict) and "pools" in data and "model" in data:
            yield str(path.relative_to(REPO)), path.read_text()
    yield "ConfigMap pdscope-config", _configmaps(_k8s_docs())["pdscope-config"]["pdscope.yaml"]


def test_every_pdscope_config_in_deploy_validates() -> None:
    found = []
    for where, text in _pdscope_configs():
        settings = parse_config(text, where)  # raises ConfigError naming file, line and field
        found.append(where)
        assert settings.pools, where
    assert {"deploy/k8s/config/pdscope.yaml", "deploy/compose/pdscope.yaml"} <= set(found)


def test_more_than_one_controller_or_collector_means_a_postgresql_store() -> None:
    """SQLite takes one controller (a second refuses to start) and one collector owning every
    target; the deployments run two of each, so their store must be PostgreSQL."""
    docs = _k8s_docs()
    deployments = _deployments(docs)
    k8s = {c: deployments[K8S_WORKLOAD[c]]["spec"]["replicas"] for c in FLEET}
    compose = _compose_counts()
    for counts, settings in ((k8s, _k8s_settings(docs)), (compose, _compose_settings())):
        if counts["control"] > 1 or counts["collect"] > 1:
            assert settings.store.url.startswith("postgresql"), settings.store.url


def _probe(container: dict[str, Any], kind: str) -> dict[str, Any]:
    probe: dict[str, Any] = container[kind]
    return probe


def test_k8s_probes_match_what_each_role_answers() -> None:
    """The controller's /healthz is 200 for a leader and a standby alike (503 only when its ticks
    or reloads fail past the lease), so readiness on it keeps a standby Ready for reads; its
    liveness asks only that the process answers, so a store outage (every replica 503) restarts
    nothing. The proxy's /healthz is 200 whenever it serves; the collector's is 503 for a dead or
    stuck background task."""
    deployments = _deployments(_k8s_docs())
    paths = {"proxy": "/healthz", "control": "/healthz", "collect": "/healthz"}
    for command, path in paths.items():
        (c,) = _pod_spec(deployments[K8S_WORKLOAD[command]])["containers"]
        assert _probe(c, "readinessProbe")["httpGet"]["path"] == path, command
        assert "livenessProbe" in c, command
    (controller,) = _pod_spec(deployments["pdscope-controller"])["containers"]
    assert _probe(controller, "livenessProbe")["httpGet"]["path"] == "/metrics"
    # every probed path is one the service serves
    served = {
        "proxy": _proxy_paths(),
        "control": _controller_paths(),
        "collect": _collector_paths(),
    }
    for command in FLEET:
        (c,) = _pod_spec(deployments[K8S_WORKLOAD[command]])["containers"]
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            if kind in c:
                assert c[kind]["httpGet"]["path"] in served[command], (command, kind)


def _controller_paths() -> set[str]:
    from types import SimpleNamespace

    from controller.endpoints import ops

    router = ops.router(SimpleNamespace(reconciler=None))  # type: ignore[arg-type]
    return {route.path for route in router.routes}  # type: ignore[attr-defined]


def _collector_paths() -> set[str]:
    from collector.receiver import build_app
    from collector.selfmetrics import CollectorMetrics
    from collector.spool import Spool

    app = build_app(Spool.memory(10), CollectorMetrics())
    return {route.path for route in app.routes}  # type: ignore[attr-defined]


def _proxy_paths() -> set[str]:
    source = (REPO / "proxy" / "app.py").read_text()
    return set(re.findall(r'path == "(/[a-z]+)" and method == "GET"', source))


def _start_controller(config: dict[str, Any], path: Path, log: Path) -> subprocess.Popen[bytes]:
    path.write_text(yaml.safe_dump(config))
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pdscope.cli", "--config", str(path), "control"],
            cwd=REPO,
            env={**os.environ, "PDSCOPE_API_TOKEN": "probe-test-token"},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


@pytest.mark.pg
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_k8s_controller_probes_keep_the_leader_and_the_standby_ready(
    pg_database: str, tmp_path: Path
) -> None:
    """The shipped config on two `pdscope control` processes and one PostgreSQL store, probed the
    way the Deployment probes them: both Ready (the standby serves reads), both live, and a change
    sent to the standby (already forwarded once) is the 409 naming the leader and its address."""
    import httpx
    import psycopg

    from tests.support.sockets import free_port
    from tests.support.waiting import wait_until

    with psycopg.connect(pg_database, autocommit=True) as conn:  # a store of its own
        conn.execute("DROP SCHEMA public CASCADE")
        conn.execute("CREATE SCHEMA public")
    docs = _k8s_docs()
    (c,) = _pod_spec(_deployments(docs)["pdscope-controller"])["containers"]
    probes = {kind: c[kind]["httpGet"]["path"] for kind in ("readinessProbe", "livenessProbe")}
    shipped = yaml.safe_load(_configmaps(docs)["pdscope-config"]["pdscope.yaml"])
    ports = [free_port(), free_port()]
    procs = []
    for i, port in enumerate(ports):
        config = copy.deepcopy(shipped)
        config["store"]["url"] = pg_database
        config["controller"] |= {"host": "127.0.0.1", "port": port}
        procs.append(_start_controller(config, tmp_path / f"c{i}.yaml", tmp_path / f"c{i}.log"))
    try:

        def health() -> list[dict[str, Any]]:
            return [httpx.get(f"http://127.0.0.1:{p}/healthz", timeout=2).json() for p in ports]

        roles = wait_until(
            "one leader and one standby",
            health,
            done=lambda hs: sorted(h.get("role", "") for h in hs) == ["leader", "standby"],
            timeout_s=90,
            every_s=0.3,
            ignore=(httpx.HTTPError, ValueError),
        )
        for port in ports:
            for kind, path in probes.items():
                r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
                assert r.status_code == 200, (kind, port, r.text)
        leader = next(i for i, h in enumerate(roles) if h["role"] == "leader")
        standby = ports[1 - leader]
        r = httpx.post(
            f"http://127.0.0.1:{standby}/v1/instances/vllm-decode-0/drain",
            json={"reason": "probe test"},
            headers={"Authorization": "Bearer probe-test-token", "X-Pdscope-Forwarded-By": "a test"},
            timeout=5,
        )
        assert r.status_code == 409, r.text  # (without the header the standby forwards it to the leader)
        assert f":{ports[leader]} (pid {procs[leader].pid}) at http://" in r.json()["leader"]["holder"]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_k8s_controller_mutations_have_a_way_to_the_leader() -> None:
    """Proxies and the dashboard use the Service over both controllers; a standby answers a
    change 409 naming the leader's pod, and the headless Service lists every replica's address
    so a client can ask each one's /healthz role."""
    docs = _k8s_docs()
    services = {s["metadata"]["name"]: s for s in _by_kind(docs, "Service")}
    labels = _deployments(docs)["pdscope-controller"]["spec"]["template"]["metadata"]["labels"]
    both = [s for s in services.values() if s["spec"]["selector"].items() <= labels.items()]
    assert {s["spec"].get("clusterIP") for s in both} == {None, "None"}
    assert urlparse(_k8s_settings(docs).controller_url).hostname == "pdscope-controller"
    assert services["pdscope-controller"]["spec"].get("clusterIP") is None


def _relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus's relabelling for the actions the shipped configs use (keep, drop, replace):
    source values joined by `;`, the regex anchored at both ends. None: the target is dropped."""
    out = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(out.get(s, "") for s in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if (action == "keep" and match is None) or (action == "drop" and match is not None):
            return None
        if action == "replace" and match is not None:
            out[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return out


def _pod_targets(workload: dict[str, Any], index: int) -> Iterator[dict[str, str]]:
    """The targets Kubernetes pod discovery yields for one pod of a workload: one per port."""
    template = workload["spec"]["template"]
    meta = {
        "__meta_kubernetes_pod_name": f"{workload['metadata']['name']}-{index}",
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_namespace": workload["metadata"]["namespace"],
    }
    for key, value in template["metadata"]["labels"].items():
        meta["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    for c in _pod_spec(workload)["containers"]:
        for port in c.get("ports", []):
            yield meta | {
                "__address__": f"10.0.0.{index}:{port['containerPort']}",
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
            }


def _scraped(prom: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, list[dict[str, str]]]:
    """job -> the labels of every target it scrapes among the manifests' pods."""
    out: dict[str, list[dict[str, str]]] = {}
    for job in prom["scrape_configs"]:
        if "kubernetes_sd_configs" not in job:
            continue
        (sd,) = job["kubernetes_sd_configs"]
        assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["pdscope"]
        for w in _by_kind(docs, "Deployment", "StatefulSet"):
            for i in range(w["spec"]["replicas"]):
                for target in _pod_targets(w, i):
                    kept = _relabel(job.get("relabel_configs", []), target)
                    if kept is not None:
                        out.setdefault(job["job_name"], []).append(
                            kept | {"_workload": w["metadata"]["name"]}
                        )
    return out


def _k8s_prometheus() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(_configmaps(_k8s_docs())["prometheus-config"]["prometheus.yml"])
    return data


def test_k8s_prometheus_scrapes_every_pdscope_replica_as_a_pod() -> None:
    """Pod discovery, not a Service address (which would reach one replica per scrape): each
    replica is a target of its job, once, with its pod name as `replica` and `instance`."""
    docs = _k8s_docs()
    prom = _k8s_prometheus()
    scraped = _scraped(prom, docs)
    deployments = _deployments(docs)
    jobs = {"proxy": "pdscope-proxy", "control": "pdscope-controller", "collect": "pdscope-collector"}
    for command, job in jobs.items():
        (config,) = [j for j in prom["scrape_configs"] if j["job_name"] == job]
        assert "static_configs" not in config and config["honor_labels"] is True
        targets = scraped[job]
        assert {t["_workload"] for t in targets} == {K8S_WORKLOAD[command]}, job
        replicas = deployments[K8S_WORKLOAD[command]]["spec"]["replicas"]
        pods = [t["replica"] for t in targets]
        assert len(pods) == len(set(pods)) == replicas, (job, pods)
        assert all(t["instance"] == t["replica"] for t in targets)
        port = {"proxy": 8000, "control": 8300, "collect": 4318}[command]
        assert all(t["__address__"].endswith(f":{port}") for t in targets)
    # no pod is scraped by two jobs
    seen = [(t["_workload"], t["__address__"]) for ts in scraped.values() for t in ts]
    assert len(seen) == len(set(seen))


def test_the_relabel_simulation_drops_what_the_keep_rule_does_not_match() -> None:
    """The simulation the scrape test relies on can fail: with the proxy job's keep regex
    misspelt, no proxy pod is scraped."""
    docs = _k8s_docs()
    prom = copy.deepcopy(_k8s_prometheus())
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "pdscope-proxy"]
    job["relabel_configs"][0]["regex"] = "pdscope-proxies"
    assert "pdscope-proxy" not in _scraped(prom, docs)
    assert len(_scraped(_k8s_prometheus(), docs)["pdscope-proxy"]) == FLEET["proxy"]


# -- compose at fleet scale ----------------------------------------------------------------


def _compose_by_command() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, svc in _compose()["services"].items():
        if svc["image"].startswith("pdscope:"):
            out.setdefault(svc["command"][2], []).append(name)
    return out


def _compose_counts() -> dict[str, int]:
    by_command = _compose_by_command()
    return {c: len(by_command.get(c, [])) for c in FLEET}


def test_compose_runs_3_proxies_2_controllers_and_2_collectors() -> None:
    services = _compose()["services"]
    by_command = _compose_by_command()
    assert _compose_counts() == FLEET
    assert len(by_command["dashboard"]) == 1 and len(by_command["db"]) == 1
    # each replica's hostname is its service name: its proxy.id / collector.id / leader name,
    # unique and resolvable on the network
    hostnames = [services[n]["hostname"] for c in FLEET for n in by_command[c]]
    assert hostnames == [n for c in FLEET for n in by_command[c]]
    # the controllers and the collectors each share the alias the config's URLs use
    aliases = _compose_aliases(services)
    settings = _compose_settings()
    assert aliases[urlparse(settings.controller_url).hostname or ""] == set(by_command["control"])
    # the proxies fail over between every controller replica
    assert {urlparse(u).hostname for u in settings.controller_urls} == set(by_command["control"])
    assert {urlparse(u).port for u in settings.controller_urls} == {settings.controller.port}
    otlp = urlparse(settings.proxy.otlp_endpoint or "").hostname or ""
    assert aliases[otlp] == set(by_command["collect"])
    assert settings.proxy.expected_replicas == sum(
        _workers(services[n]["command"]) for n in by_command["proxy"]
    )


def _haproxy_servers() -> list[tuple[str, int]]:
    text = (COMPOSE / "haproxy.cfg").read_text()
    return [(h, int(p)) for h, p in re.findall(r"^\s*server \S+ ([\w.-]+):(\d+)\b", text, re.M)]


def test_compose_entry_point_balances_over_every_proxy() -> None:
    services = _compose()["services"]
    settings = _compose_settings()
    lb = services["pdscope-proxy"]
    assert not lb["image"].startswith("pdscope:")
    assert lb["ports"] == [f"127.0.0.1:{settings.proxy.port}:8000"]
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in lb["volumes"]
    assert re.search(r"^\s*bind :8000$", (COMPOSE / "haproxy.cfg").read_text(), re.M)
    proxies = _compose_by_command()["proxy"]
    assert sorted(_haproxy_servers()) == sorted((p, settings.proxy.port) for p in proxies)
    assert set(lb["depends_on"]) == set(proxies)
    assert "option httpchk GET /healthz" in (COMPOSE / "haproxy.cfg").read_text()


def test_compose_haproxy_config_is_valid() -> None:
    import shutil

    haproxy = shutil.which("haproxy")
    if haproxy is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy) to check haproxy.cfg")
    out = subprocess.run(
        [haproxy, "-c", "-f", str(COMPOSE / "haproxy.cfg")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_prometheus_scrapes_every_pdscope_replica() -> None:
    settings = _compose_settings()
    by_command = _compose_by_command()
    ports = {
        "proxy": settings.proxy.port,
        "control": settings.controller.port,
        "collect": settings.collector.port,
    }
    files = {
        "proxy": "pdscope-proxy.yml",
        "control": "pdscope-controller.yml",
        "collect": "pdscope-collector.yml",
    }
    for command, file in files.items():
        groups = yaml.safe_load((COMPOSE / "prometheus-targets" / file).read_text())
        targets = {t: g.get("labels", {}) for g in groups for t in g["targets"]}
        assert set(targets) == {f"{name}:{ports[command]}" for name in by_command[command]}, file
        replicas = [labels.get("replica") for labels in targets.values()]
        assert None not in replicas and len(set(replicas)) == len(replicas), file


# -- OpenTelemetry Collector -----------------------------------------------------------------

OTEL = DEPLOY / "otel-collector"
OTEL_FILES = ("config.yaml", "loadbalancing.yaml", "pdscope-sidecar.yaml")


def _otel(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((OTEL / name).read_text())
    return data


@pytest.mark.parametrize("name", OTEL_FILES)
def test_otel_collector_pipelines_use_defined_components_in_order(name: str) -> None:
    cfg = _otel(name)
    assert set(cfg) <= {"receivers", "processors", "exporters", "extensions", "connectors", "service"}
    service = cfg["service"]
    for ext in service.get("extensions", []):
        assert ext in cfg["extensions"], (name, ext)
    (pipeline,) = service["pipelines"].values()
    assert list(service["pipelines"]) == ["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for component in pipeline[kind]:
            assert component in cfg[kind], (name, kind, component)
            # "<type>[/<name>]": the type is what the collector looks up
            assert re.fullmatch(r"[a-z_]+(/[\w-]+)?", component), component
    assert pipeline["processors"][0] == "memory_limiter" and pipeline["processors"][-1] == "batch"
    limiter = cfg["processors"]["memory_limiter"]
    assert (
        limiter["check_interval"]
        and 0 < limiter["spike_limit_percentage"] < limiter["limit_percentage"] < 100
    )
    # one OTLP receiver; the agents listen on loopback only (a sender beside them)
    (receiver,) = pipeline["receivers"]
    assert receiver == "otlp"
    protocols = cfg["receivers"]["otlp"]["protocols"]
    if name != "pdscope-sidecar.yaml":
        assert set(protocols) == {"grpc", "http"}
        assert all(p["endpoint"].startswith("127.0.0.1:") for p in protocols.values())
    for exporter in pipeline["exporters"]:
        exp = cfg["exporters"][exporter]
        retry = exp.get("retry_on_failure", {})
        queue = exp.get("sending_queue", {})
        assert retry.get("enabled") is True and queue.get("enabled") is True, (name, exporter)


def _collector_service_port(docs: list[dict[str, Any]], host: str) -> int:
    """The port of the k8s Service `host` names (svc or svc.pdscope.svc), which must select the
    pdscope collectors."""
    first, *rest = host.split(".")
    assert rest in ([], ["pdscope", "svc"], ["pdscope", "svc", "cluster", "local"]), host
    (svc,) = [s for s in _by_kind(docs, "Service") if s["metadata"]["name"] == first]
    labels = _deployments(docs)["pdscope-collector"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    return int(port["port"])


def test_otel_agent_exports_to_the_pdscope_collectors_traces_path() -> None:
    """otlphttp appends /v1/traces to `endpoint`: so the endpoint is the collectors' Service and
    port with no path, and endpoint + /v1/traces is the route pdscope's collector serves."""
    docs = _k8s_docs()
    cfg = _otel("config.yaml")
    (name,) = cfg["service"]["pipelines"]["traces"]["exporters"]
    assert name.split("/")[0] == "otlphttp"
    exp = cfg["exporters"][name]
    assert "traces_endpoint" not in exp
    url = urlparse(exp["endpoint"])
    assert url.scheme == "http" and url.path in ("", "/") and not url.query
    assert url.port == _collector_service_port(docs, url.hostname or "") == _k8s_settings(docs).collector.port
    assert url.path.rstrip("/") + "/v1/traces" in _collector_paths()
    # the collector's OTLP token, from the environment, as a bearer header
    assert re.fullmatch(r"Bearer \$\{env:[A-Z_]+\}", exp["headers"]["Authorization"])


def test_otel_loadbalancing_reaches_pdscope_through_the_sidecar() -> None:
    """The loadbalancing exporter speaks OTLP/gRPC only: it must target the sidecar's gRPC port,
    and the sidecar forwards OTLP/HTTP to the pdscope collector in its pod."""
    lb = _otel("loadbalancing.yaml")
    (name,) = lb["service"]["pipelines"]["traces"]["exporters"]
    exp = lb["exporters"][name]
    assert name.split("/")[0] == "loadbalancing" and exp["routing_key"] == "traceID"
    assert set(exp["protocol"]) == {"otlp"} and "endpoint" not in exp["protocol"]["otlp"]
    assert exp["protocol"]["otlp"]["tls"]["insecure"] is True
    dns = exp["resolver"]["dns"]
    sidecar = _otel("pdscope-sidecar.yaml")
    grpc = sidecar["receivers"]["otlp"]["protocols"]["grpc"]
    assert set(sidecar["receivers"]["otlp"]["protocols"]) == {"grpc"}
    assert int(dns["port"]) == int(grpc["endpoint"].rsplit(":", 1)[1])
    assert int(dns["port"]) != _k8s_settings(_k8s_docs()).collector.port  # not pdscope's HTTP port
    # the sidecar: to the pdscope collector on loopback, appending /v1/traces, passing the
    # sender's own Authorization on (so pdscope still authenticates each sender)
    (out,) = sidecar["service"]["pipelines"]["traces"]["exporters"]
    url = urlparse(sidecar["exporters"][out]["endpoint"])
    assert url.hostname == "127.0.0.1" and url.port == _k8s_settings(_k8s_docs()).collector.port
    assert url.path in ("", "/")
    assert sidecar["exporters"][out]["auth"]["authenticator"] == "headers_setter"
    (header,) = sidecar["extensions"]["headers_setter"]["headers"]
    assert header["key"] == "Authorization" and header["from_context"] == "authorization"
    assert grpc["include_metadata"] is True
    assert "authorization" in sidecar["processors"]["batch"]["metadata_keys"]
    # and the README's headless Service selects the collectors on that port
    readme = (OTEL / "README.md").read_text()
    svc = yaml.safe_load(readme.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert dns["hostname"].split(".")[0] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["port"] == int(dns["port"])
    labels = _deployments(_k8s_docs())["pdscope-collector"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


# -- Dockerfile ---------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    lines = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip("\\").strip() + " "
        if not raw.endswith("\\"):
            instr, _, rest = pending.strip().partition(" ")
            lines.append((instr.upper(), rest.strip()))
            pending = ""
    return lines


def test_dockerfile_copies_every_package_and_runs_pdscope() -> None:
    import tomllib

    instructions = _dockerfile()
    froms = [rest for instr, rest in instructions if instr == "FROM"]
    assert froms and all(re.match(r"python:3\.1[1-9][\w.-]*( AS \w+)?$", f) for f in froms), froms
    copied = set()
    for instr, rest in instructions:
        if instr == "COPY" and not rest.startswith("--from"):
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                copied.add(src.rstrip("/"))
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages not copied into the image: {packages - copied}"
    entry = [json.loads(rest) for instr, rest in instructions if instr == "ENTRYPOINT"]
    assert entry == [["pdscope"]]
    assert any(instr == "USER" for instr, _ in instructions), "the image must not run as root"
    exposed = {int(p) for instr, rest in instructions if instr == "EXPOSE" for p in rest.split()}
    defaults = Settings.model_fields
    assert {
        defaults["proxy"].default.port,
        defaults["collector"].default.port,
        defaults["controller"].default.port,
        defaults["dashboard"].default.port,
    } <= exposed


def test_dockerignore_keeps_the_packages_in_the_context() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "**" in ignore
    for instr, rest in _dockerfile():
        if instr == "COPY" and not rest.startswith("--from"):
            for src in shlex.split(rest)[:-1]:
                assert f"!{src.rstrip('/')}/" in ignore or f"!{src}" in ignore, src


# -- Grafana ------------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DEPLOY / "grafana" / "pdscope-dashboard.json").read_text())
    return data


def test_grafana_dashboard_is_fresh_and_well_formed() -> None:
    build = _load("build_dashboard", DEPLOY / "grafana" / "build_dashboard.py")
    assert (DEPLOY / "grafana" / "pdscope-dashboard.json").read_text() == build.render()
    dash = _dashboard()
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == [
        "Fleet",
        "KV transfer (NIXL)",
        "Prefix cache & KV-aware routing",
        "SLOs & alerts",
        "Controller & proxy",
        "Capacity",
    ]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "pool", "instance"} <= set(variables)
    for p in panels:
        if p["type"] == "row":
            continue
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
    # panels do not overlap
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))


def _row_exprs(title: str) -> list[str]:
    """The PromQL of the panels under the row ``title`` (up to the next row)."""
    exprs: list[str] = []
    inside = False
    for p in _dashboard()["panels"]:
        if p["type"] == "row":
            inside = p["title"] == title
        elif inside:
            exprs.extend(t["expr"] for t in p["targets"])
    return exprs


def test_grafana_prefix_cache_row_shows_hit_rates_routes_predictions_and_stream_health() -> None:
    exprs = _row_exprs("Prefix cache & KV-aware routing")
    hit_rate = re.compile(
        r"rate\(vllm:prefix_cache_hits_total\{[^}]*\}\[5m\]\)\) / sum by \(instance\) "
        r"\(rate\(vllm:prefix_cache_queries_total"
    )
    assert any(hit_rate.search(e) for e in exprs), exprs
    assert any("vllm:external_prefix_cache_hits_total" in e and 'role="decode"' in e for e in exprs)
    for series in (
        "pdscope_proxy_routes_total",
        "pdscope_proxy_predicted_cached_tokens_total",
        "pdscope_proxy_prompt_tokens_routed_total",
        "pdscope_proxy_kv_events_last_message_age_seconds",
        "pdscope_proxy_kv_index_stale",
    ):
        assert any(series in e for e in exprs), series
    assert any('path="decode_only"' in e for e in exprs), "the share served without P"


def test_grafana_panels_filter_vllm_series_by_the_pool_variable() -> None:
    for p in _dashboard()["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            if re.search(r"vllm:|pool_role:|instance:vllm", expr) and "up{" not in expr:
                assert 'pool=~"$pool"' in expr, (p["title"], expr)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "pdscope.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and urlparse(source["url"]).hostname == "prometheus"
    assert "prometheus" in _compose()["services"]
    assert "prometheus" in {s["metadata"]["name"] for s in _by_kind(_k8s_docs(), "Service")}
    providers = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "pdscope.yml").read_text()
    )
    path = providers["providers"][0]["options"]["path"]
    grafana = _compose()["services"]["grafana"]
    assert any(v.endswith(f"{path}/pdscope-dashboard.json:ro") for v in grafana["volumes"])


def test_render_scripts_check_mode_reports_fresh_files() -> None:
    for script in (K8S / "render_configmaps.py", DEPLOY / "grafana" / "build_dashboard.py"):
        out = subprocess.run(
            [sys.executable, str(script), "--check"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr


def test_shipped_prometheus_targets_match_the_demo_config() -> None:
    """deploy/prometheus/targets/ scrape exactly the fleet and services of examples/pdscope.yaml."""
    settings = load_config(REPO / "examples" / "pdscope.yaml")
    targets = DEPLOY / "prometheus" / "targets"
    vllm: dict[str, tuple[str, str, str]] = {}
    for path in sorted(targets.glob("vllm-*.yml")):
        role, _, pool = path.stem.removeprefix("vllm-").partition("-")
        for group in yaml.safe_load(path.read_text()):
            for target in group["targets"]:
                labels = group.get("labels", {})
                vllm[labels["instance"]] = (
                    target,
                    labels.get("pool", pool or role),
                    labels.get("role", role),
                )
    expected = {
        inst.name: (urlparse(inst.url).netloc, pool, settings.pools[pool].role)
        for pool, inst in settings.instances()
    }
    assert vllm == expected
    for job, section in (
        ("proxy", settings.proxy),
        ("collector", settings.collector),
        ("controller", settings.controller),
    ):
        (group,) = yaml.safe_load((targets / f"pdscope-{job}.yml").read_text())
        assert group["targets"] == [f"{section.host}:{section.port}"], job

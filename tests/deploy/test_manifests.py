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
    "pdscope-secrets": {"api-token", "db-password", "hf-token", "otlp-proxy-token", "otlp-vllm-token"}
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
    urls += [settings.controller_url, settings.proxy.otlp_endpoint or ""]
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
    urls += [settings.controller_url, settings.proxy.otlp_endpoint or "", settings.store.url]
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
    assert rows == ["Fleet", "KV transfer (NIXL)", "SLOs & alerts", "Controller & proxy", "Capacity"]
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

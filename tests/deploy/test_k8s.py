"""deploy/k8s: plain manifests an operator applies with `kubectl apply -k`. Every Service
reaches a container port, the routers' probes hit open router routes, the router's URLs name
engine pods that exist (StatefulSet ordinals behind headless Services) on the ports they
listen on, and the router replicas share one Redis."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    DEPLOY,
    kv_events_config,
    load_one,
    load_yaml,
    probe_routes,
    router_args,
    sglang_flags,
    sglang_source,
    value,
)

K8S = DEPLOY / "k8s"
Docs = dict[tuple[str, str], dict[str, Any]]  # (kind, name) -> document


@pytest.fixture(scope="module")
def docs() -> Docs:
    kustomization = load_one(K8S / "kustomization.yaml")
    files = kustomization["resources"]
    assert sorted(files) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    out: Docs = {}
    for name in files:
        for doc in load_yaml(K8S / name):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), (name, doc)
            # namespace-agnostic: `kubectl apply -k . -n NS` puts everything in one place
            assert "namespace" not in doc["metadata"], name
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, key
            out[key] = doc
    return out


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def port_of(c: dict[str, Any], port: int | str) -> int:
    """A container port by number or name (AssertionError when it has none such)."""
    for p in c.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"{c['name']} has no port {port}")


def router(docs: Docs) -> tuple[dict[str, Any], Any]:
    deployment = docs["Deployment", "memserve-router"]
    return deployment, router_args(container(deployment)["args"])


def test_router_deployment_has_replicas_probes_resources_and_its_key(docs) -> None:
    deployment, args = router(docs)
    assert deployment["spec"]["replicas"] >= 2
    c = container(deployment)
    open_routes = probe_routes()
    for probe, path in (("readinessProbe", "/readiness"), ("livenessProbe", "/liveness")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and path in open_routes
        assert port_of(c, get["port"]) == args.port
    assert c["startupProbe"]["httpGet"]["path"] in open_routes
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    env = {e["name"]: e for e in c["env"]}
    secret = env["MEMSERVE_ROUTER_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"]
    assert "--api-key" not in c["args"]  # a flag would show in `ps` and in the manifest
    # each replica's name in Redis is its pod's (Kubernetes expands $(POD_NAME) in args)
    assert args.replica_id == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args.host == "0.0.0.0" and args.prometheus_host == "0.0.0.0"
    assert args.kv_events_subscribe and args.kv_events_bind is None
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == args.prometheus_port
    assert port_of(c, args.prometheus_port) == args.prometheus_port


def test_router_tokenizer_is_on_a_mounted_volume(docs) -> None:
    deployment, args = router(docs)
    mounts = [m["mountPath"] for m in container(deployment)["volumeMounts"]]
    assert any(str(args.tokenizer_path).startswith(m + "/") for m in mounts)


def test_every_service_selects_a_workload_and_reaches_its_ports(docs) -> None:
    workloads = [d for (kind, _), d in docs.items() if kind in {"Deployment", "StatefulSet"}]
    for (kind, _), service in docs.items():
        if kind != "Service":
            continue
        selector = service["spec"]["selector"]
        (target,) = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selector.items() <= target["spec"]["selector"]["matchLabels"].items()
        for port in service["spec"]["ports"]:
            port_of(container(target), port.get("targetPort", port["port"]))


def test_routers_share_the_redis_service_which_keeps_nothing(docs) -> None:
    _, args = router(docs)
    url = urlsplit(args.redis_url)
    service = docs["Service", url.hostname]
    assert url.port in [p["port"] for p in service["spec"]["ports"]]
    redis = container(docs["Deployment", url.hostname])
    assert value(redis["args"], "--save") == "" and value(redis["args"], "--appendonly") == "no"


def test_router_urls_name_engine_pods_that_exist(docs) -> None:
    """http://STATEFULSET-ORDINAL.SERVICE:PORT: a headless Service gives every pod that name,
    so each router replica reaches, and subscribes to, each engine pod."""
    _, args = router(docs)
    ((prefill_url, bootstrap),) = args.prefill
    (decode_url,) = args.decode
    for url, mode in ((prefill_url, "prefill"), (decode_url, "decode")):
        parts = urlsplit(url)
        pod, service = str(parts.hostname).split(".")
        name, ordinal = pod.rsplit("-", 1)
        sts = docs["StatefulSet", name]
        assert int(ordinal) < sts["spec"]["replicas"]
        assert sts["spec"]["serviceName"] == service
        assert docs["Service", service]["spec"]["clusterIP"] == "None"
        cmd = container(sts)["command"]
        assert value(cmd, "--disaggregation-mode") == mode
        assert int(value(cmd, "--port")) == parts.port == port_of(container(sts), "http")
        assert value(cmd, "--page-size") == str(args.page_size)
        assert value(cmd, "--model-path") == str(args.tokenizer_path)
        if mode == "prefill":
            assert value(cmd, "--disaggregation-bootstrap-port") == bootstrap
    assert args.pd_caching in {"basic", "caching-1"}  # SGLang has no decode write-back


def test_engines_have_gpus_probes_and_kv_events_to_subscribe_to(docs) -> None:
    engines = [d for (kind, _), d in docs.items() if kind == "StatefulSet"]
    assert len(engines) == 2
    for sts in engines:
        c = container(sts)
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
        config = kv_events_config(c["command"])
        for endpoint in (config["endpoint"], config["replay_endpoint"]):
            assert endpoint.startswith("tcp://*:")  # binds; every router replica connects
            port_of(c, int(endpoint.rsplit(":", 1)[1]))
        assert "--enable-cache-report" in c["command"] and "--enable-metrics" in c["command"]
        annotations = sts["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == int(value(c["command"], "--port"))


def test_sglang_knows_every_flag_the_engines_are_given(docs) -> None:
    srt = sglang_source()
    if srt is None:
        pytest.skip("sglang is not installed: its server_args.py cannot be read")
    used = {
        a
        for (kind, _), d in docs.items()
        if kind == "StatefulSet"
        for a in container(d)["command"]
        if a.startswith("--")
    }
    assert used <= sglang_flags(srt), used - sglang_flags(srt)


def test_a_disruption_budget_keeps_a_router_serving(docs) -> None:
    deployment, _ = router(docs)
    pdb = docs["PodDisruptionBudget", "memserve-router"]
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    assert 1 <= pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_prometheus_keeps_the_annotated_pods() -> None:
    config = load_one(DEPLOY / "monitoring" / "prometheus-k8s.yml")
    (job,) = config["scrape_configs"]
    rules = {r["source_labels"][0]: r for r in job["relabel_configs"] if "source_labels" in r}
    scrape = rules["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert scrape["action"] == "keep" and scrape["regex"] == "true"
    assert "__meta_kubernetes_pod_annotation_prometheus_io_path" in rules


def test_kustomize_builds_the_manifests(docs) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert len(re.findall(r"^kind: ", out.stdout, re.M)) == len(docs)

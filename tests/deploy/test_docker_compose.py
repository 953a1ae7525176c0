"""deploy/docker-compose.yml and what it mounts (nginx.conf, Prometheus, Grafana): every
router command is one the router accepts, the replicas agree with each other and with the
engines, and every address one service uses for another is where that one listens."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import (
    DEPLOY,
    kv_events_config,
    load_one,
    probe_routes,
    router_args,
    sglang_flags,
    sglang_source,
    value,
)

COMPOSE = DEPLOY / "docker-compose.yml"


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data = load_one(COMPOSE)
    services: dict[str, Any] = data["services"]
    return services


def routers(services: dict[str, Any]) -> dict[str, list[str]]:
    return {
        name: s["command"]
        for name, s in services.items()
        if "router" in s.get("image", "") and "--policy" in s.get("command", [])
    }


def engines(services: dict[str, Any]) -> dict[str, list[str]]:
    return {
        name: s["command"]
        for name, s in services.items()
        if "sglang.launch_server" in s.get("command", [])
    }


def test_two_router_replicas_share_one_redis_and_subscribe_to_kv_events(services) -> None:
    commands = routers(services)
    assert len(commands) >= 2
    args = {name: router_args(argv) for name, argv in commands.items()}
    ids = [a.replica_id for a in args.values()]
    assert None not in ids and len(set(ids)) == len(ids), ids  # a replica's name in Redis
    redis = urlsplit(next(iter(args.values())).redis_url)
    assert {a.redis_url for a in args.values()} == {redis.geturl()}
    assert redis.hostname in services and redis.port == 6379
    redis_cmd = services[redis.hostname]["command"]
    assert value(redis_cmd, "--save") == "" and value(redis_cmd, "--appendonly") == "no"
    for a in args.values():
        assert a.kv_events_subscribe and a.kv_events_bind is None
        assert a.host == "0.0.0.0"  # reachable from the gateway and Prometheus containers
        assert a.prometheus_port and a.prometheus_host == "0.0.0.0"
        assert a.tokenizer_path  # the engines load for minutes: the router cannot ask them
    # the replicas differ only in their names
    same = [{k: v for k, v in vars(a).items() if k != "replica_id"} for a in args.values()]
    assert all(s == same[0] for s in same)
    for name in commands:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_routers_point_at_the_engines_where_they_listen(services) -> None:
    engine = engines(services)
    for argv in routers(services).values():
        args = router_args(argv)
        ((prefill_url, bootstrap),) = args.prefill
        (decode_url,) = args.decode
        for url, mode in ((prefill_url, "prefill"), (decode_url, "decode")):
            parts = urlsplit(url)
            cmd = engine[parts.hostname]
            assert value(cmd, "--disaggregation-mode") == mode
            assert int(value(cmd, "--port")) == parts.port
            assert value(cmd, "--host") == "0.0.0.0"
            assert value(cmd, "--page-size") == str(args.page_size)
            assert value(cmd, "--model-path") == str(args.tokenizer_path)
        assert value(engine[urlsplit(prefill_url).hostname], "--disaggregation-bootstrap-port") == (
            bootstrap
        )
        # SGLang has no decode-to-prefill write-back: caching-2/3 would mislead the trees
        assert args.pd_caching in {"basic", "caching-1"}


def test_engines_publish_kv_events_every_replica_can_subscribe_to(services) -> None:
    commands = engines(services)
    assert {value(c, "--disaggregation-mode") for c in commands.values()} == {"prefill", "decode"}
    for name, cmd in commands.items():
        config = kv_events_config(cmd)
        assert config["publisher"] == "zmq"
        for endpoint in (config["endpoint"], config["replay_endpoint"]):
            assert re.fullmatch(r"tcp://\*:\d+", endpoint), endpoint  # binds: replicas connect
        assert "topic" not in config  # the subscriber knows the worker by its socket
        assert "--enable-cache-report" in cmd and "--enable-metrics" in cmd
        assert value(cmd, "--disaggregation-transfer-backend")
        gpus = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert gpus[0]["capabilities"] == ["gpu"]


def test_sglang_knows_every_flag_the_engines_are_given(services) -> None:
    srt = sglang_source()
    if srt is None:
        pytest.skip("sglang is not installed: its server_args.py cannot be read")
    known = sglang_flags(srt)
    used = {a for cmd in engines(services).values() for a in cmd if a.startswith("--")}
    assert used <= known, used - known


def test_healthchecks_use_open_router_routes(services) -> None:
    """A probe on a route behind the API key would 401 and mark every replica unhealthy."""
    open_routes = probe_routes()
    for name, argv in routers(services).items():
        check = " ".join(services[name]["healthcheck"]["test"])
        (url,) = re.findall(r"http://[^'\" ]+", check)
        parts = urlsplit(url)
        assert parts.path in open_routes and parts.port == router_args(argv).port
        assert services[name]["environment"]["MEMSERVE_ROUTER_API_KEY"].startswith("${")
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]


def test_the_gateway_balances_over_every_replica_and_streams(services) -> None:
    conf = (DEPLOY / "docker" / "nginx.conf").read_text()
    upstream = set(re.findall(r"^\s*server ([\w-]+):(\d+)", conf, re.M))
    expected = {(n, str(router_args(a).port)) for n, a in routers(services).items()}
    assert upstream == expected
    assert re.search(r"proxy_buffering off;", conf)  # SSE chunks reach the client as they come
    default = router_args(["--policy", "prompt-tree"])
    read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", conf)[1])  # type: ignore[index]
    assert read_timeout >= default.request_timeout_secs
    body = re.search(r"client_max_body_size (\d+)m;", conf)
    assert body and int(body[1]) * 2**20 >= default.max_payload_size
    gateway = services["gateway"]
    assert "./docker/nginx.conf:/etc/nginx/nginx.conf:ro" in gateway["volumes"]
    assert gateway["ports"] == ["30000:30000"]


def test_prometheus_scrapes_every_router_and_engine(services) -> None:
    config = load_one(DEPLOY / "monitoring" / "prometheus.yml")
    targets = {
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    expected = {f"{n}:{router_args(a).prometheus_port}" for n, a in routers(services).items()}
    expected |= {f"{n}:{value(c, '--port')}" for n, c in engines(services).items()}
    assert targets == expected


def test_every_mounted_file_and_the_build_exist(services) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        build = service.get("build")
        if build:
            context = DEPLOY / build["context"]
            assert (context / build["dockerfile"]).exists()
            assert (context / "pyproject.toml").exists()


def test_grafana_provisions_the_dashboard_and_its_datasource(services) -> None:
    grafana = services["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    provider = load_one(DEPLOY / "monitoring/grafana/dashboards/memserve.yml")
    path = provider["providers"][0]["options"]["path"]
    assert mounts["./monitoring/grafana-dashboard.json"].startswith(path + "/")
    datasource = load_one(DEPLOY / "monitoring/grafana/datasources/prometheus.yml")
    (prometheus,) = datasource["datasources"]
    assert prometheus["type"] == "prometheus" and prometheus["isDefault"]
    assert urlsplit(prometheus["url"]).hostname in services
    config = "/etc/prometheus/prometheus.yml"
    assert f"--config.file={config}" in services["prometheus"]["command"]
    assert f"./monitoring/prometheus.yml:{config}:ro" in services["prometheus"]["volumes"]

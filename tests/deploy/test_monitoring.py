"""deploy/monitoring/grafana-dashboard.json: a dashboard Grafana loads, whose every query names
series the router exports (its registry as `python -m router` builds it, histograms' and
counters' suffixes included) or SGLang exports, and which shows what an operator of the
router looks at: hit ratio, TTFT, per-worker load and prediction accuracy, decisions by reason,
errors, replicas."""

from __future__ import annotations

import pytest

from tests.deploy.manifests import (
    dashboard,
    dashboard_exprs,
    dashboard_metrics,
    panels,
    router_metric_names,
    sglang_metric_names,
    sglang_source,
)


@pytest.fixture(scope="module")
def board() -> dict:
    return dashboard()


def test_dashboard_is_a_grafana_dashboard(board) -> None:
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in board["templating"]["list"]}
    for panel in panels(board):
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        # every query goes to the datasource the importer picks (a variable, not a fixed uid)
        uid = panel["datasource"]["uid"]
        assert uid.startswith("${") and uid[2:-1] in variables, panel["title"]


def test_every_query_names_a_metric(board) -> None:
    """A typo'd prefix would match nothing here and draw an empty panel forever."""
    for expr in dashboard_exprs(board):
        assert dashboard_metrics({"panels": [{"targets": [{"expr": expr}]}]}), expr


def test_router_metrics_in_the_dashboard_exist() -> None:
    used = {m for m in dashboard_metrics(dashboard()) if not m.startswith("sglang:")}
    missing = used - router_metric_names()
    assert not missing, f"the router exports no {sorted(missing)}"


def test_sglang_metrics_in_the_dashboard_exist() -> None:
    """Against the installed SGLang's collectors (the end-to-end test checks the same names
    against this project's CPU workers, which export SGLang's)."""
    srt = sglang_source()
    if srt is None:
        pytest.skip("sglang is not installed: its metric names cannot be read")
    declared = sglang_metric_names(srt)
    for name in {m for m in dashboard_metrics(dashboard()) if m.startswith("sglang:")}:
        base = name.removesuffix("_bucket").removesuffix("_total")
        assert {name, base} & declared, name


def test_dashboard_shows_what_an_operator_watches(board) -> None:
    exprs = "\n".join(dashboard_exprs(board))
    for needed in (
        "sgl_router_cache_hits_total",  # hit ratio
        "sgl_router_cache_misses_total",
        "histogram_quantile(0.5, sum by (le) (rate(sglang:time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le) (rate(sglang:time_to_first_token_seconds_bucket",
        "max by (worker) (sgl_router_worker_load",  # per-worker load
        # per-worker prediction accuracy: foreseen over reported cached tokens, and the gauge
        "sum by (worker) (rate(memserve_router_worker_predicted_hit_tokens_total",
        "sum by (worker) (rate(memserve_router_worker_reported_cached_tokens_total",
        "memserve_router_prediction_accuracy",
        # each worker's learned speed: per-token multiple and overhead (router.speed)
        'memserve_router_worker_speed{instance=~"$router", term="per_token"}',
        "memserve_router_worker_overhead_seconds",
        "sum by (reason) (rate(sgl_router_load_balancing_events_total",  # decisions by reason
        "sgl_router_request_errors_total",
        "memserve_router_replica_lag_seconds_bucket",  # propagation between replicas
        "memserve_router_replica_ops_dropped_total",
        "memserve_router_redis_up",
    ):
        assert needed in exprs, needed

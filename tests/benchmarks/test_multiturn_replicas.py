"""Router replicas in the multi-turn benchmark: the round-robin front, the replicated system's
processes and propagation delay, its place in the plans and its report.

The front runs as the benchmark runs it (`python -m benchmarks.multiturn.front`), in front of
two fake replicas that say who answered, so forwarding, streaming, turn-taking and a dead
replica are seen from outside. The replicated system is started for real (redis-server, two
routers, the front) on two sim workers publishing KV events; the quick preset's run (in
test_multiturn.py) checks it inside a whole benchmark.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from benchmarks.load.bodies import served_model
from benchmarks.multiturn.cluster import RouterSpec, sync_events
from benchmarks.multiturn.plan import TWO_REPLICAS, make_plan
from benchmarks.multiturn.replicas import (
    LAG,
    bucket_quantile,
    propagation,
    replica_metrics,
    start_replicated,
)
from benchmarks.multiturn.replicas_report import sections, summary
from benchmarks.multiturn.trace import TraceReplay
from benchmarks.multiturn.workloads import MultiRoundQA
from benchmarks.peers import OURS
from localrun.cluster import Cluster, ClusterSpec
from localrun.processes import LOOPBACK, Launch, Server, free_port, module_command, wait_until

STREAM_PAUSE_S = 0.6  # between a fake replica's first and last SSE chunk


# --------------------------------------------------------------------------- fake replicas


def fake_replica(name: str) -> web.Application:
    """Echoes what it received (and its name); /stream sends two SSE chunks a pause apart."""

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        seen = {
            "replica": name,
            "method": request.method,
            "path_qs": request.rel_url.raw_path_qs,
            "body": body.decode(),
            "x_test": request.headers.get("X-Test"),
        }
        return web.json_response(seen, headers={"X-Replica": name})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {name} first\n\n".encode())
        await asyncio.sleep(STREAM_PAUSE_S)
        await response.write(b"data: last\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    """Two fake replicas on one event loop in a thread: their URLs."""
    loop = asyncio.new_event_loop()
    ports = [free_port(), free_port()]
    runners = [web.AppRunner(fake_replica(n), access_log=None) for n in ("a", "b")]

    async def up() -> None:
        for runner, port in zip(runners, ports, strict=True):
            await runner.setup()
            await web.TCPSite(runner, LOOPBACK, port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(up(), loop).result(10)
    try:
        yield [f"http://{LOOPBACK}:{p}" for p in ports]
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def start_front(urls: list[str], log_dir: Path) -> Server:
    port = free_port()
    command = module_command("benchmarks.multiturn.front", port, [f"--replica={u}" for u in urls])
    server = Launch("front", command, port, log_dir / f"front-{port}.log").start()
    why = wait_until(server, lambda: status(server.url + "/up") > 0, 20, poll_s=0.05)
    if why is not None:
        server.stop()
        pytest.fail(why)
    return server


def status(url: str) -> int:
    """The HTTP status of a GET (any status: the server answered)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def front(replicas: list[str], tmp_path: Path) -> Iterator[Server]:
    server = start_front(replicas, tmp_path)
    try:
        yield server
    finally:
        server.stop()


def call(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, Any, Any]:
    req = urllib.request.Request(url, data=body, method=method, headers={"X-Test": "kept"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc), exc.headers


# --------------------------------------------------------------------------- the front


def test_front_forwards_method_path_headers_and_body(front: Server) -> None:
    code, seen, headers = call(front.url + "/v1/x?a=1&b=two", "PUT", b'{"k": "v"}')
    assert code == 200
    assert seen["method"] == "PUT" and seen["path_qs"] == "/v1/x?a=1&b=two"
    assert seen["body"] == '{"k": "v"}' and seen["x_test"] == "kept"
    assert headers["X-Replica"] == seen["replica"]  # the replica's headers come back


def test_front_takes_replicas_in_turn(front: Server) -> None:
    names = [call(front.url + f"/turn/{i}")[1]["replica"] for i in range(6)]
    assert all(a != b for a, b in itertools.pairwise(names)), names
    assert names.count("a") == names.count("b") == 3


def test_front_relays_a_stream_chunk_by_chunk(front: Server) -> None:
    """The first SSE event arrives while the replica still waits to send the rest."""
    host, port = LOOPBACK, front.port
    for _ in range(2):  # each replica once
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            started = time.perf_counter()
            conn.request("GET", "/stream")
            resp = conn.getresponse()
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            first = resp.read1(65536)
            first_at = time.perf_counter() - started
            rest = resp.read()
            done_at = time.perf_counter() - started
        finally:
            conn.close()
        assert first.endswith(b" first\n\n"), first
        assert first_at < STREAM_PAUSE_S / 2, f"first chunk after {first_at:.3f} s: buffered"
        assert rest == b"data: last\n\ndata: [DONE]\n\n" and done_at >= STREAM_PAUSE_S


def test_front_answers_502_json_for_a_replica_that_is_down(
    replicas: list[str], tmp_path: Path
) -> None:
    dead = f"http://{LOOPBACK}:{free_port()}"
    server = start_front([replicas[0], dead], tmp_path)
    try:
        answers = [call(server.url + "/v1/chat/completions", "POST", b"{}") for _ in range(4)]
    finally:
        server.stop()
    codes = [code for code, _, _ in answers]
    assert sorted(codes) == [200, 200, 502, 502], codes
    for code, body, headers in answers:
        if code == 502:
            assert headers["Content-Type"].startswith("application/json")
            assert body["error"]["type"] == "bad_gateway" and body["error"]["replica"] == dead
            assert dead in body["error"]["message"]


def test_front_refuses_to_listen_beyond_loopback() -> None:
    args = [sys.executable, "-m", "benchmarks.multiturn.front", "--host", "0.0.0.0"]
    done = subprocess.run(
        [*args, "--port", "1", "--replica", "http://x"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "127.0.0.1 only" in done.stderr


# --------------------------------------------------------------------------- measurements


def histogram(counts: dict[str, float], total_s: float) -> dict[str, float]:
    """A replica's lag histogram as `scrape` returns it (cumulative buckets)."""
    out = {f'{LAG}_bucket{{le="{le}"}}': n for le, n in counts.items()}
    count = max(counts.values())
    return {**out, f"{LAG}_count": count, f"{LAG}_sum": total_s}


def test_bucket_quantiles_interpolate_as_prometheus_does() -> None:
    buckets = {0.001: 10.0, 0.005: 90.0, 0.01: 100.0, float("inf"): 100.0}
    assert bucket_quantile(buckets, 0.05) == pytest.approx(0.0005)  # inside the first bucket
    assert bucket_quantile(buckets, 0.5) == pytest.approx(0.001 + 0.004 * 40 / 80)
    assert bucket_quantile(buckets, 0.99) == pytest.approx(0.005 + 0.005 * 9 / 10)
    assert bucket_quantile({0.1: 0.0, float("inf"): 4.0}, 0.5) == 0.1  # all above: the bound
    assert bucket_quantile({0.1: 0.0, float("inf"): 0.0}, 0.5) is None


def test_propagation_is_this_runs_share_of_every_replica() -> None:
    """After minus before, per replica and pooled: an earlier run's ops do not count."""
    before = [
        histogram({"0.001": 5, "0.005": 5, "+Inf": 5}, 0.004),
        histogram({"0.001": 0, "0.005": 0, "+Inf": 0}, 0.0),
    ]
    after = [
        histogram({"0.001": 5, "0.005": 15, "+Inf": 15}, 0.034),  # 10 new, 1..5 ms
        histogram({"0.001": 10, "0.005": 10, "+Inf": 10}, 0.005),  # 10 new, under 1 ms
    ]
    after[0]["memserve_router_replica_ops_applied_total"] = 10.0
    got = propagation(before, after)
    assert got["count"] == 20 and got["applied"] == 10 and got["dropped"] == 0
    assert got["mean_s"] == pytest.approx(0.035 / 20)
    assert got["p50_s"] == pytest.approx(0.001)  # half under 1 ms
    assert got["per_replica"][0]["p50_s"] == pytest.approx(0.003)
    assert got["p99_s"] == pytest.approx(0.001 + 0.004 * 9.8 / 10)


def run(system: str, workload: str, seed: int, hit: float, **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "workload": workload,
        "seed": seed,
        "group": "main",
        "available": True,
        "hit_ratio": hit,
        "ttft_p50_s": 0.2,
        "ttft_p99_s": 1.0,
        "output_tokens_per_s": 100.0,
        **extra,
    }


def test_report_pairs_the_replicas_with_the_single_router_per_seed() -> None:
    prop = {"count": 50.0, "p50_s": 0.002, "p99_s": 0.008, "mean_s": 0.003, "dropped": 0.0}
    front = {"liveness": {"added_p50_ms": 0.4}, "chat_stream": {"added_p50_ms": 0.7}}
    runs = [
        run("ours prompt_tree", "trace", 1, 0.50),
        run("ours prompt_tree x2 replicas", "trace", 1, 0.47, propagation=prop),
        run("ours prompt_tree", "trace", 2, 0.60),
        run("ours prompt_tree x2 replicas", "trace", 2, 0.52, front_overhead=front),
        run("sglang-router cache_aware", "trace", 1, 0.55),
    ]
    got = summary(runs)["trace"]
    assert [p["seed"] for p in got["per_seed"]] == [1, 2]
    assert got["hit_gap_points"]["min"] == pytest.approx(-8.0)
    assert got["hit_gap_points"]["max"] == pytest.approx(-3.0)
    assert got["within_5_points"] == 1 and got["seeds"] == 2
    assert got["lag_p99_s"]["median"] == 0.008 and got["lag_p99_s"]["n"] == 1
    assert got["front_chat_added_p50_ms"]["median"] == 0.7
    md = "\n".join(sections(summary(runs)))
    assert "## Router replicas" in md and "### trace" in md
    assert "over 2 seeds" in md and "within 5 points in 1 of 2" in md


def test_both_presets_run_two_replicas_next_to_the_single_router() -> None:
    for quick in (True, False):
        plan = make_plan(quick)
        main = [
            s
            for s in plan.steps
            if s.group == "main" and isinstance(s.workload, TraceReplay | MultiRoundQA)
        ]
        assert len(main) == 2
        for step in main:
            names = [s.name for s in step.systems]
            assert "ours prompt_tree" in names and TWO_REPLICAS.name in names, names
    assert TWO_REPLICAS.name == "ours prompt_tree x2 replicas"
    assert RouterSpec(OURS, "prompt_tree").name == "ours prompt_tree"


def test_seeds_repeat_the_main_workloads_labelled() -> None:
    plan = make_plan(
        False,
        workloads={"trace", "multi_round_qa"},
        systems={"ours prompt_tree", TWO_REPLICAS.name},
        seeds=(1, 2, 3),
    )
    main = [s for s in plan.steps if s.group == "main"]
    assert len(main) == 6
    assert sorted(s.labels["seed"] for s in main) == [1, 1, 2, 2, 3, 3]
    assert {s.workload.seed for s in main} == {1, 2, 3}
    assert all(s.labels == {} for s in plan.steps if s.group != "main")


# --------------------------------------------------------------------------- end to end


def test_replicated_system_shares_trees_and_stops_everything(
    model_dir: Path, tmp_path: Path
) -> None:
    """Two sim workers publishing KV events; redis, two replicas and the front: a
    conversation whose turns alternate replicas hits the cache from its second turn, both
    replicas hear every worker, the lag histogram counts the other's ops, and stopping the
    system leaves no process behind."""
    cluster = Cluster.create(
        ClusterSpec("rep", colocated=2, kv_events=True), model_dir, tmp_path, None
    )
    cluster.start()
    try:
        model = served_model(cluster.workers[0].url)
        system = start_replicated(TWO_REPLICAS, cluster, tmp_path, model)
        try:
            assert len(system.replicas) == 2 and [h.name for h in system.helpers] == ["redis"]
            calibration = system.extra["front_overhead"]
            assert calibration["liveness"]["front_p50_ms"] > 0
            assert sync_events([s.url for s in system.routers], cluster)
            before = replica_metrics(system)
            cached = converse(system.url, model, turns=6)
            time.sleep(0.1)
            prop = propagation(before, replica_metrics(system))
            infos = [info(s.url) for s in system.replicas]
        finally:
            system.stop()
    finally:
        cluster.stop()
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    assert prop["count"] > 0 and prop["dropped"] == 0
    assert all(r["count"] > 0 for r in prop["per_replica"])  # each applied the other's ops
    # (a histogram p99 of under 100 ops: one op past 1 s on a loaded machine reads as 2.5)
    assert 0 < prop["p50_s"] <= prop["p99_s"] <= 2.5
    for got in infos:
        assert got["kv_events"]["mode"] == "subscribe"
        assert set(got["kv_events"]["sources"]) == {w.url for w in cluster.workers}
        assert all(s.startswith("ipc://") for s in got["kv_events"]["sources"].values())
        assert got["replica"]["redis_up"] and len(got["replica"]["peers"]) == 1
    assert all(p.proc.poll() is not None for p in system.processes())
    assert cluster.events_dir is not None and not cluster.events_dir.exists()


def converse(url: str, model: str, turns: int, think_s: float = 1.0) -> list[int]:
    """One causal chat through `url`: each turn's cached tokens. The user thinks `think_s`
    before each next turn: longer than the replicas' propagation delay (its p99 is asserted
    below 1 s), so the replica that takes a turn has heard where the last one went."""
    messages = [{"role": "user", "content": "tell me about caches " * 60}]
    cached = []
    for i in range(turns):
        body = json.dumps({"model": model, "messages": messages, "max_tokens": 8}).encode()
        req = urllib.request.Request(
            url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.load(resp)
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        answer = out["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"{i}"}]
        time.sleep(think_s)
    return cached


def info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
        got = json.load(resp)
    assert isinstance(got, dict)
    return got

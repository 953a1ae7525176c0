"""KV events reach every router replica (--kv-events-subscribe), as real processes: workers
bind their publishers, each replica finds them in the workers' /get_server_info and
subscribes; traffic that bypasses the routers shows in every replica's trees without a
replica op through Redis; a replica started later replays what it missed; a worker
killed and restarted is forgotten, then followed from its new start."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import redis

from router.replicas.ops import DROP, FORGET, RECORD, decode_op
from tests.http_client import call
from tests.procs import Server, free_port, running
from tests.router.test_router import router

# 10, 10 and 20 pages of 16 tokens
PROMPTS = [[5000 + 1000 * i + t for t in range(n)] for i, n in enumerate((160, 160, 320))]


def events_config(run_dir: Path, port: int) -> str:
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"ipc://{run_dir}/kv-{port}.sock",
            "replay_endpoint": f"ipc://{run_dir}/kv-{port}-replay.sock",
        }
    )


def worker(model_dir: Path, run_dir: Path, port: int) -> contextlib.AbstractContextManager[Server]:
    args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    args += ["--kv-events-config", events_config(run_dir, port)]
    return running("connector.worker", args, run_dir, port=port)


def replica(urls: list[str], run_dir: Path, redis_url: str, name: str, *extra: str):
    return router(
        urls,
        run_dir,
        *extra,
        "--redis-url",
        redis_url,
        "--replica-id",
        name,
        "--kv-events-subscribe",
        "--replica-snapshot-secs",
        "1",
    )


def info(r: Server) -> dict:
    return call(r.url + "/get_server_info")[1]


def pages_of(r: Server, url: str) -> int:
    return info(r).get("tree_holders", {}).get("colocated", {}).get(url, 0)


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def tree_ops(redis_url: str) -> list[str]:
    """The kinds of the tree ops in the replicas' shared stream (heartbeats left out)."""
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange("memserve:trees")
    finally:
        client.close()
    raw = [fields[b"m"] for _, fields in entries or () if fields]
    kinds = [decode_op(m).op for m in raw if isinstance(m, bytes)]
    return [k for k in kinds if k in (RECORD, DROP, FORGET)]


def generate(url: str, tokens: list[int]) -> None:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1}}
    assert call(url + "/generate", body)[0] == 200


def test_every_replica_hears_every_worker(model_dir: Path, tmp_path: Path, redis_url: str) -> None:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    with contextlib.ExitStack() as stack:
        workers = [stack.enter_context(worker(model_dir, tmp_path, p)) for p in ports]
        a = stack.enter_context(replica(urls, tmp_path, redis_url, "a"))
        b = stack.enter_context(replica(urls, tmp_path, redis_url, "b"))
        for r in (a, b):
            assert set(info(r)["kv_events"]["sources"]) == set(urls)

        # Traffic that bypasses both routers: only the events tell them.
        generate(workers[0].url, PROMPTS[0])
        generate(workers[1].url, PROMPTS[1])
        for r in (a, b):
            wait_for(lambda r=r: all(pages_of(r, u) >= 10 for u in urls))  # type: ignore[misc]
        # each learned it from the workers, not from the other through Redis
        assert tree_ops(redis_url) == []

        # A replica started now replays what the workers published before it.
        late = stack.enter_context(replica(urls, tmp_path, redis_url, "late"))
        wait_for(lambda: all(pages_of(late, u) >= 10 for u in urls))
        events = info(late)["kv_events"]
        assert events["replayed"] >= 2 and events["lost"] == 0
        metrics = call(late.url + "/metrics")[1]
        assert f"memserve_router_kv_event_replayed_total {float(events['replayed'])}" in metrics
        assert "memserve_router_kv_event_lost_total 0.0" in metrics

        # Worker 1 is killed and comes back as a new process with an empty cache.
        proc = workers[1].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        restarted = stack.enter_context(worker(model_dir, tmp_path, ports[1]))
        generate(restarted.url, PROMPTS[2])
        for r in (a, b, late):  # PROMPTS[1]'s 10 pages went with the old process
            wait_for(lambda r=r: pages_of(r, urls[1]) == 20, timeout=15)  # type: ignore[misc]
            assert pages_of(r, urls[0]) == 10


def test_a_worker_down_when_the_router_starts_is_followed_once_it_is_up(
    model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # (no worker to ask for the tokenizer: it is named)
    with replica([url], tmp_path, redis_url, "early", "--tokenizer-path", str(model_dir)) as r:
        assert info(r)["kv_events"]["sources"] == {}
        with worker(model_dir, tmp_path, port) as w:
            wait_for(lambda: url in info(r)["kv_events"]["sources"], timeout=15)
            generate(w.url, PROMPTS[0])
            wait_for(lambda: pages_of(r, url) == 10)


def batches(r: Server) -> float:
    """The router's memserve_router_kv_event_batches_total, from its /metrics."""
    metrics = call(r.url + "/metrics")[1]
    (line,) = [x for x in metrics.splitlines() if x.startswith("memserve_router_kv_event_batches")]
    return float(line.split()[-1])


def test_a_worker_bound_on_a_concrete_address_is_followed_there(
    model_dir: Path, tmp_path: Path
) -> None:
    """An engine that keeps its publisher off public interfaces binds loopback (SGLang's
    `"bind": true`): the router follows it at that address, replay socket included. A
    worker that binds 0.0.0.0 is followed at its URL's host; one given a concrete address
    without "bind" connects (SGLang's rule) and the router says why it cannot follow it."""
    bound, wildcard, pushing = free_port(), free_port(), free_port()
    pub, replay, wild = free_port(), free_port(), free_port()
    configs = {
        bound: {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        },
        wildcard: {"publisher": "zmq", "endpoint": f"tcp://0.0.0.0:{wild}"},
        pushing: {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}"},
    }
    urls = {port: f"http://127.0.0.1:{port}" for port in configs}
    with contextlib.ExitStack() as stack:
        workers = {
            port: stack.enter_context(
                running(
                    "connector.worker",
                    ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
                    + ["--kv-events-config", json.dumps(config)],
                    tmp_path,
                    port=port,
                )
            )
            for port, config in configs.items()
        }
        r = stack.enter_context(router(list(urls.values()), tmp_path, "--kv-events-subscribe"))
        assert info(r)["kv_events"]["sources"] == {
            urls[bound]: f"tcp://127.0.0.1:{pub}",
            urls[wildcard]: f"tcp://127.0.0.1:{wild}",
        }
        # traffic that bypasses the router: only the events tell it
        generate(workers[bound].url, PROMPTS[0])
        generate(workers[wildcard].url, PROMPTS[1])
        # one batch from each (10 pages each): counted in /metrics, applied to the tree
        wait_for(lambda: batches(r) >= 2 and info(r)["tree_pages"]["colocated"] >= 20)
        assert info(r)["kv_events"]["lost"] == 0
        assert r.log is not None
        said = r.log.read_text()
        assert f"cannot subscribe to the KV events of {urls[pushing]}" in said
        assert 'without "bind": true' in said

        # a router started later replays what it missed from the loopback replay socket
        late = stack.enter_context(router([urls[bound]], tmp_path, "--kv-events-subscribe"))
        wait_for(lambda: info(late)["tree_pages"]["colocated"] >= 10)
        assert info(late)["kv_events"]["replayed"] >= 1

"""The trees follow the engines' real cache: KV events make them exact, feedback corrects them."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.http_client import call
from tests.procs import free_port, running

PROMPT = list(range(1000, 1200))  # 200 tokens: 12 whole pages


def tree_pages(router_url: str) -> int:
    return call(router_url + "/get_server_info")[1]["tree_pages"]["colocated"]


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_router_learns_the_cache_from_kv_events(model_dir: Path, tmp_path: Path) -> None:
    events_port, worker_port = free_port(), free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    config = json.dumps(
        {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": worker_url}
    )
    worker_args = [
        "--backend",
        "sim",
        "--model-path",
        str(model_dir),
        "--time-scale",
        "0",
        "--kv-events-config",
        config,
    ]
    router_args = [
        "--policy",
        "prompt_tree",
        "--worker-urls",
        worker_url,
        "--kv-events-bind",
        f"tcp://127.0.0.1:{events_port}",
    ]
    with (
        running("connector.worker", worker_args, tmp_path, port=worker_port),
        running("router", router_args, tmp_path) as router,
    ):
        assert tree_pages(router.url) == 0
        # Traffic that bypasses the router: only the KV events can tell it about this cache.
        # (The first batches may be lost while the subscription forms: send until heard.)
        for i in range(20):
            call(
                worker_url + "/generate",
                {"input_ids": [i, *PROMPT], "sampling_params": {"max_new_tokens": 4}},
            )
            if wait_for(lambda: tree_pages(router.url) > 0, timeout=0.5):
                break
        assert tree_pages(router.url) >= 12
        info = call(router.url + "/get_server_info")[1]
        assert info["kv_events"]["batches"] >= 1 and info["kv_events"]["unknown_topics"] == 0
        # The worker drops its cache: AllBlocksCleared empties the router's tree.
        assert call(worker_url + "/flush_cache", method="POST", raw=b"")[0] == 200
        assert wait_for(lambda: tree_pages(router.url) == 0)


def test_feedback_drops_a_path_the_worker_no_longer_holds(model_dir: Path, tmp_path: Path) -> None:
    worker_args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    with (
        running("connector.worker", worker_args, tmp_path) as worker,
        running(
            "router", ["--policy", "prompt_tree", "--worker-urls", worker.url], tmp_path
        ) as router,
    ):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}
        assert call(router.url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 0
        assert call(router.url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 192

        def stats() -> dict:  # answers teach the trees a moment after they are relayed
            return call(router.url + "/get_server_info")[1]["tree_stats"]

        assert wait_for(lambda: stats()["reported_cached_tokens"] == 192)
        assert stats()["predicted_cached_tokens"] == 192
        # The worker evicts behind the router's back (no KV events here).
        assert call(worker.url + "/flush_cache", method="POST", raw=b"")[0] == 200
        assert call(router.url + "/generate", body)[1]["meta_info"]["cached_tokens"] == 0
        assert wait_for(lambda: stats()["corrections"] == 1)
        now = stats()
        assert now["predicted_cached_tokens"] == 2 * 192 and now["reported_cached_tokens"] == 192
        metrics = call(router.url + "/metrics")[1]
        assert "memserve_router_predicted_cached_tokens_total 384.0" in metrics
        assert "memserve_router_reported_cached_tokens_total 192.0" in metrics

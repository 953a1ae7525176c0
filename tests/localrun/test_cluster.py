"""`python -m router` with no workers named starts its own, serves chat, and cleans up."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

from tests.http_client import call
from tests.procs import running


def listening(url: str) -> bool:
    parts = urlsplit(url)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((parts.hostname, parts.port)) == 0


def test_router_starts_local_workers_and_stops_them(model_dir: Path, tmp_path: Path) -> None:
    args = ["--policy", "prompt-tree", "--local-backend", "sim", "--local-workers", "2"]
    with running("router", args, tmp_path, timeout=180) as router:
        assert call(router.url + "/readiness")[0] == 200
        status, body = call(
            router.url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        workers = [w["url"] for w in call(router.url + "/workers")[1]["workers"]]
        assert len(workers) == 2 and all(listening(u) for u in workers)
    assert not any(listening(u) for u in workers)  # stopped with the router, no orphans


def test_one_launcher_builds_each_workers_command(tmp_path: Path) -> None:
    """The same `Cluster` starts the operator's local workers (their default model, output
    to the terminal) and the benchmarks' (a model path, a log each, sim time scales, PD
    roles with a bootstrap port on the prefill)."""
    from localrun.cluster import Cluster, ClusterSpec

    local = Cluster.create(
        ClusterSpec("local", colocated=2, backend="hf", worker_args=("--page-size", "16")),
        model_dir=None,
        log_dir=None,
    )
    for worker in local.workers:
        args = worker.launch.args
        assert worker.launch.log is None and "--model-path" not in args
        assert "--threads" in args and "--time-scale" not in args
        assert args[-2:] == ["--page-size", "16"]
    pd = Cluster.create(
        ClusterSpec("pd", prefills=1, decodes=1, caching="caching-3", time_scale=2.0),
        model_dir=tmp_path,
        log_dir=tmp_path,
    )
    prefill, decode = pd.workers
    assert prefill.role == "prefill" and prefill.bootstrap_port is not None
    assert decode.role == "decode" and decode.bootstrap_port is None
    for worker in pd.workers:
        args = worker.launch.args
        assert args[args.index("--time-scale") + 1] == "2"
        assert args[args.index("--model-path") + 1] == str(tmp_path)
        assert args[args.index("--pd-caching") + 1] == "caching-3"
        assert worker.launch.log == tmp_path / f"{worker.name}.log"
    assert len({w.url for w in [*local.workers, *pd.workers]}) == 4

#!/usr/bin/env python3
"""Router replicas sharing one Redis, in front of CPU workers, all on 127.0.0.1: the
replicated deployment of docker-compose.yml and k8s/ on one machine.

    python3 deploy/replicas-local.py [--routers 2] [--workers 2] [--backend sim|hf] \
        [--model-path DIR] [-- ROUTER FLAGS...]

Starts a redis-server without persistence, the workers (each publishing its KV events on an
ipc:// socket in the run directory, which every router replica subscribes to), then the
routers with --redis-url and --kv-events-subscribe. Prints every URL once all routers are
ready; Ctrl-C or SIGTERM stops everything. Logs stay in the run directory.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere, with or without the package installed

from localrun.processes import (  # noqa: E402
    Launch,
    Server,
    free_port,
    http_ok,
    module_command,
    redis_url,
    start_all,
    start_redis,
    stop_all,
    wait_until,
)

START_TIMEOUT_S = 180.0  # hf workers load the model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", choices=["sim", "hf"], default="sim")
    p.add_argument("--model-path", help="the workers' model (default: the tiny model)")
    p.add_argument("--run-dir", help="logs and KV-event sockets (default: a new temp dir)")
    p.add_argument("router_args", nargs="*", help="after --: more flags for every router")
    return p.parse_args()


def worker_launch(args: argparse.Namespace, run: Path, i: int) -> Launch:
    # ipc:// endpoints: a worker binds them, and nothing listens beyond this machine (a
    # tcp://*:PORT endpoint, as on a cluster, would listen on every interface).
    events = {
        "publisher": "zmq",
        "endpoint": f"ipc://{run}/kv-{i}",
        "replay_endpoint": f"ipc://{run}/kv-{i}-replay",
    }
    extra = ["--backend", args.backend, "--instance-id", str(i)]
    extra += ["--kv-events-config", json.dumps(events)]
    if args.model_path:
        extra += ["--model-path", args.model_path]
    port = free_port()
    cmd = module_command("connector.worker", port, extra)
    return Launch(f"worker-{i}", cmd, port, run / f"worker-{i}.log", ROOT)


def router_launch(
    args: argparse.Namespace, run: Path, i: int, redis_url: str, urls: list[str]
) -> Launch:
    extra = ["--policy", "prompt-tree", "--worker-urls", *urls, "--kv-events-subscribe"]
    extra += ["--redis-url", redis_url, "--replica-id", f"router-{i}", *args.router_args]
    port = free_port()
    cmd = module_command("router", port, extra)
    return Launch(f"router-{i}", cmd, port, run / f"router-{i}.log", ROOT)


def ready(server: Server) -> None:
    """A router is ready once it knows a healthy worker (GET /readiness answers 200)."""
    why = wait_until(server, lambda: http_ok(server.url + "/readiness", timeout=1), 60)
    if why is not None:
        raise RuntimeError(why)


def stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds into main's finally, which stops every child


def watch(servers: list[Server]) -> int:
    """Until a signal: a child that exits on its own ends the run (with its log's end)."""
    while True:
        for s in servers:
            if s.exited() is not None:
                print(f"{s.name} exited with {s.exited()}: {s.tail()}", file=sys.stderr)
                return 1
        time.sleep(0.5)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    run = Path(args.run_dir or tempfile.mkdtemp(prefix="memserve-replicas-"))
    run.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        redis = start_redis(run / "redis.log")
        servers.append(redis)
        redis_address = redis_url(redis)
        workers = [worker_launch(args, run, i) for i in range(1, args.workers + 1)]
        servers += start_all(workers, START_TIMEOUT_S)
        urls = [s.url for s in servers[1:]]
        routers = [
            router_launch(args, run, i, redis_address, urls) for i in range(1, args.routers + 1)
        ]
        servers += start_all(routers, START_TIMEOUT_S)
        for router in servers[-len(routers) :]:
            ready(router)
        print(f"redis     {redis_address}")
        for s in servers[1:]:
            print(f"{s.name:<9} {s.url}")
        print(f"ready: logs in {run}; Ctrl-C stops everything", flush=True)
        return watch(servers)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut this short
            signal.signal(sig, signal.SIG_IGN)
        stop_all(servers)


if __name__ == "__main__":
    sys.exit(main())

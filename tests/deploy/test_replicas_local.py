"""deploy/replicas-local.py end to end, as an operator runs it: two router replicas sharing a
redis-server in front of two sim workers, every KV event reaching both replicas; stopped by
SIGTERM with nothing left behind, nothing ever listening beyond 127.0.0.1."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.deploy.manifests import DEPLOY, dashboard, dashboard_metrics, scraped_names
from tests.http_client import call
from tests.procs import TEST_ENV
from tests.router.test_router import SYSTEM
from tests.router.test_security import listening

SCRIPT = DEPLOY / "replicas-local.py"
READY_TIMEOUT_S = 120.0


class Run:
    """The script as a child process: its printed URLs, its pid's process tree."""

    def __init__(self, proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
        self.proc = proc
        self.lines = lines
        self.urls: dict[str, str] = {}
        self.output: list[str] = []

    def wait_ready(self) -> float:
        started = time.monotonic()
        while time.monotonic() - started < READY_TIMEOUT_S:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "\n".join(self.output)
                continue
            self.output.append(line)
            name, _, url = line.partition(" ")
            if name.startswith(("router-", "worker-", "redis")):
                self.urls[name] = url.strip()
            if line.startswith("ready:"):
                return time.monotonic() - started
        raise AssertionError("not ready:\n" + "\n".join(self.output))

    def routers(self) -> list[str]:
        return [u for n, u in sorted(self.urls.items()) if n.startswith("router-")]

    def workers(self) -> list[str]:
        return [u for n, u in sorted(self.urls.items()) if n.startswith("worker-")]

    def descendants(self) -> set[int]:
        """Every process under the script, now."""
        found: set[int] = set()
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                children = (task / "children").read_text().split()
                todo += [int(c) for c in children if int(c) not in found]
                found.update(int(c) for c in children)
        return found


@pytest.fixture
def run(model_dir: Path, tmp_path: Path) -> Iterator[Run]:
    cmd = [sys.executable, str(SCRIPT), "--model-path", str(model_dir)]
    cmd += ["--run-dir", str(tmp_path), "--", "--health-check-interval-secs", "0.5"]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,  # not the repository: the script finds its packages itself
        env={**os.environ, **TEST_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def read() -> None:  # a thread: the test waits on the queue with a timeout
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        yield Run(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()  # only if the test failed before its own SIGTERM
            proc.wait()


def chat(url: str, question: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    }
    status, answer = call(url + "/v1/chat/completions", {**body, "max_tokens": 8})
    assert status == 200, answer
    return answer


def wait_for(check, timeout: float = 10.0) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"not within {timeout} s"
        time.sleep(0.01)
    return time.monotonic() - started


def info(url: str) -> dict:
    status, body = call(url + "/get_server_info")
    assert status == 200, body
    return body


def test_replicas_share_trees_and_kv_events_and_stop_cleanly(run: Run) -> None:
    startup = run.wait_ready()
    routers, workers = run.routers(), run.workers()
    assert len(routers) == 2 and len(workers) == 2
    for url in routers:
        assert call(url + "/readiness")[0] == 200
        kv = info(url)["kv_events"]
        assert kv["mode"] == "subscribe" and set(kv["sources"]) == set(workers)
        assert all(source.startswith("ipc://") for source in kv["sources"].values())

    first, second = routers
    chat(first, "Where is my parcel?")
    # the prompt routed by one replica is in the other's trees, the same pages per holder
    converged = wait_for(lambda: info(second)["tree_holders"] == info(first)["tree_holders"])
    held = info(second)["tree_holders"]["colocated"]
    assert set(held) <= set(workers) and sum(held.values()) > 0
    # the worker's KV events reached the replica that did not route the request, too
    assert info(second)["kv_events"]["batches_applied"] > 0
    assert info(second)["replica"]["peers"] == ["router-1"]

    status, answer = call(
        second + "/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}
    )
    assert status == 200 and answer["meta_info"]["completion_tokens"] > 0
    check_dashboard_series(routers[0], workers[0])

    children = run.descendants()
    assert len(children) == 5  # redis, 2 workers, 2 routers
    bound = listening(run.proc.pid)
    assert {h for h, _ in bound} == {"127.0.0.1"}, bound
    ports = {p for _, p in bound}
    assert {urlsplit(u).port for u in run.urls.values()} <= ports

    started = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=30) == 128 + signal.SIGTERM
    stopped = time.monotonic() - started
    alive = {pid for pid in children if Path(f"/proc/{pid}").exists()}
    assert not alive, alive
    timings = f"converged in {converged * 1000:.0f} ms, stopped in {stopped:.1f} s"
    print(f"ready in {startup:.1f} s, {timings}")


def check_dashboard_series(router: str, worker: str) -> None:
    """The dashboard's series in a real scrape of a replica (the router's) and of a worker
    (SGLang's names, which this project's workers export too)."""
    names = set()
    for url in (router, worker):
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            names |= scraped_names(resp.read().decode())
    missing = dashboard_metrics(dashboard()) - names
    assert not missing, sorted(missing)

"""The router-overhead benchmark's parts on their own: the router CPU it reads from /proc,
and the Python floor it measures beside the routers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers import SGLANG_ROUTER, SMG, PeerStatus
from benchmarks.router_overhead.floor_proxy import CLIENTS
from benchmarks.router_overhead.phases import tree_cpu_s
from benchmarks.router_overhead.profile import section, summarize
from benchmarks.router_overhead.systems import BEFORE, cpu_sets, make_systems
from localrun.processes import LOOPBACK
from tests.http_client import call
from tests.procs import ROOT, free_port, running

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"


def test_router_cpu_counts_the_processes_it_started() -> None:
    """A router with --processes N spends its CPU in children: the parent alone would read
    near zero. A process that is gone reads 0, not an error."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])",
        ],
        start_new_session=True,
    )
    try:
        time.sleep(1.5)
        first = tree_cpu_s(parent.pid)
        deadline = time.monotonic() + 20  # a busy machine gives the spinner less than a core
        while tree_cpu_s(parent.pid) - first <= 0.5 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tree_cpu_s(parent.pid) - first > 0.5  # the child's spinning
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the parent and its spinning child
        parent.wait()
    assert tree_cpu_s(parent.pid) == 0.0


@pytest.mark.parametrize("client", CLIENTS)
def test_the_python_floor_forwards_and_says_what_fails(
    model_dir: Path, tmp_path: Path, client: str
) -> None:
    worker_args = ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    module = "benchmarks.router_overhead.floor_proxy"
    flags = ["--client", client]
    with (
        running("connector.worker", worker_args, tmp_path) as worker,
        running(module, ["--worker-urls", worker.url, *flags], tmp_path) as floor,
    ):
        for _ in range(3):  # its pooled connection reused
            status, answer = call(floor.url + "/v1/chat/completions", chat)
            assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
        status, answer = call(floor.url + "/v1/models", method="GET")
        assert status == 405 and "POST requests only" in answer["error"]["message"]
    nobody = f"http://{LOOPBACK}:{free_port()}"
    with running(module, ["--worker-urls", nobody, *flags], tmp_path) as floor:
        status, answer = call(floor.url + "/v1/chat/completions", chat)
        assert status == 502 and answer["error"]["message"] == "worker unreachable"


def test_before_runs_an_earlier_checkouts_router_beside_ours(tmp_path: Path) -> None:
    """`--before DIR`: the same router command, started from DIR, on every CPU set, listed as
    a reference (not ours) and run by DIR's own install; a DIR without a router or without
    its own install is refused with a message."""
    peers = {p: PeerStatus(False, None, "not here") for p in (SGLANG_ROUTER, SMG)}
    systems = make_systems(["http://127.0.0.1:1"], tmp_path, peers, before=tmp_path)
    before = [s for s in systems if s.name.startswith(BEFORE)]
    assert [s.policy for s in before].count("prompt_tree") == len(cpu_sets())
    assert [s.policy for s in before].count("round_robin") == 1
    for s in before:
        assert s.kind == "reference" and s.launch is not None and s.launch.cwd == tmp_path
        assert "router" in s.launch.args  # run by DIR's own install, not by ours
        assert str(tmp_path / ".venv" / "bin" / "python") in s.launch.args
    assert any("[granian]" in s.name for s in systems)  # full runs: the floor's variants too
    quick = make_systems(["http://127.0.0.1:1"], tmp_path, peers, floor_variants=False)
    assert not any(s.name.startswith(BEFORE) or "[" in s.name for s in quick)
    ours = [s for s in systems if s.kind == "ours"]
    assert ours and all(s.launch is not None and s.launch.cwd != tmp_path for s in ours)

    def refusal() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.router_overhead", "--out", str(tmp_path)]
            + ["--before", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0
        return done.stderr

    assert "no router/__main__.py there" in refusal()
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "__main__.py").write_text("")
    assert "it needs its own install" in refusal()


def test_a_profile_sums_self_time_by_function_and_inclusive_time_by_module() -> None:
    """py-spy's raw stacks: the top of each stack is self time; a project module counts
    every sample that passes through it once; one on every stack (the entry) is left out."""
    raw = "\n".join(
        [
            "main (router/__main__.py:10);select (router/policies.py:300);decide (_radix.so) 5",
            "main (router/__main__.py:10);serve (router/http_app.py:20);"
            "serve (router/http_app.py:9) 3",
            "main (router/__main__.py:10);_PyEval_EvalFrameDefault (libpython3.11.so) 2",
            "not a stack line",
        ]
    )
    fig = summarize(raw)
    assert fig["samples"] == 10
    assert fig["self"][0] == {"name": "decide (_radix.so)", "share": 0.5}
    assert {"name": "serve (http_app.py)", "share": 0.3} in fig["self"]
    inclusive = {row["name"]: row["share"] for row in fig["inclusive"]}
    assert inclusive == {"router/policies.py": 0.5, "router/http_app.py": 0.3}
    page = "\n".join(section({"available": True, "system": "ours", "seconds": 2, **fig}))
    assert "`decide (_radix.so)` | 50.0%" in page
    assert "No profile" in "\n".join(section({"available": False, "reason": "no py-spy"}))

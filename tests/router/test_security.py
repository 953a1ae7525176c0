"""What an operator relies on when the gateway faces a network: the API key stays secret, the
logs hold no request content at the default level, and every socket of the cluster (router,
metrics, KV events, PD bootstrap, MemPool agents) listens only on the address given.
The MemPool control plane's secret is tested in tests/mempool/transfer/test_agent.py."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from localrun import processes as procs
from tests.http_client import call
from tests.procs import ROOT, TEST_ENV, Server, free_port, running

KEY = "sk-kangaroo-5e1f0c2d9b"
MARKER = "quokka-zebra-7731"  # request content that must not reach a log


def sim(model_dir: Path, *extra: str) -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0", *extra]


def post(url: str, body: Any, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def get(url: str, key: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read())


def test_the_api_key_guards_inference_and_is_never_logged_or_shown(
    model_dir: Path, tmp_path: Path
) -> None:
    with (
        running("connector.worker", sim(model_dir), tmp_path) as worker,
        running(
            "router",
            ["--worker-urls", worker.url, "--api-key", KEY, "--log-level", "debug"],
            tmp_path,
        ) as router,
    ):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for key in (None, "", "wrong", KEY[:-1], KEY + "x", KEY.upper()):
            status, body = post(router.url + "/v1/chat/completions", chat, key)
            assert status == 401 and body["code"] == 401, (key, body)
        assert post(router.url + "/v1/chat/completions", chat, KEY)[0] == 200
        assert post(router.url + "/generate", {"text": "hi"}, KEY)[0] == 200
        shown = [get(router.url + p, KEY)[1] for p in ("/get_server_info", "/workers")]
        assert call(router.url + "/health")[0] == 200  # probes need no key
    assert KEY not in json.dumps(shown)
    for server in (router, worker):
        assert server.log is not None
        assert KEY not in server.log.read_text(errors="replace"), server.name


def test_the_api_key_can_come_from_the_environment(model_dir: Path, tmp_path: Path) -> None:
    """A flag shows in every user's `ps`; the environment does not."""
    env = {**TEST_ENV, "MEMSERVE_ROUTER_API_KEY": KEY}
    with (
        running("connector.worker", sim(model_dir), tmp_path) as worker,
        procs.running("router", ["--worker-urls", worker.url], tmp_path, cwd=ROOT, env=env) as r,
    ):
        assert post(r.url + "/generate", {"text": "hi"})[0] == 401
        assert post(r.url + "/generate", {"text": "hi"}, KEY)[0] == 200
        assert KEY not in Path(f"/proc/{r.proc.pid}/cmdline").read_text()


def test_no_request_content_is_logged_at_the_default_level(model_dir: Path, tmp_path: Path) -> None:
    """Prompts are users' data: served, refused or failed, they stay out of the logs."""
    with (
        running("connector.worker", sim(model_dir, "--context-length", "512"), tmp_path) as worker,
        running("router", ["--worker-urls", worker.url], tmp_path) as router,
    ):
        said = f"my secret is {MARKER}"
        chat = {"messages": [{"role": "user", "content": said}], "max_tokens": 4}
        assert post(router.url + "/v1/chat/completions", chat)[0] == 200
        assert post(router.url + "/generate", {"text": said})[0] == 200
        streamed = urllib.request.Request(
            router.url + "/generate",
            json.dumps({"text": said, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(streamed, timeout=60) as resp:
            assert resp.read().endswith(b"data: [DONE]\n\n")
        # refused: a bad role, a prompt past the context, an unknown model
        bad_role = {"messages": [{"role": 7, "content": said}]}
        assert post(router.url + "/v1/chat/completions", bad_role)[0] == 400
        too_long = {"text": said * 200}
        assert post(router.url + "/generate", too_long)[0] == 400
        unknown = {**chat, "model": MARKER}
        assert post(router.url + "/v1/chat/completions", unknown)[0] == 404
        assert post(worker.url + "/generate", too_long)[0] == 400
    for server in (router, worker):
        assert server.log is not None
        assert MARKER not in server.log.read_text(errors="replace"), server.name


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in `pid` and its children."""
    pids = {pid}
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            pids.update(int(c) for c in children)
    inodes: set[str] = set()
    for p in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    out = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            out.add((decode_address(address, width), int(port, 16)))
    return out


def decode_address(hex_address: str, width: int) -> str:
    """/proc/net/tcp{,6}'s little-endian words as a dotted or colon address."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    joined = b"".join(words)
    if width == 8:
        return ".".join(str(b) for b in joined)
    if joined[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in joined[12:])
    return ":".join(joined[i : i + 2].hex() for i in range(0, 16, 2))


def test_every_socket_listens_on_loopback_only(model_dir: Path, tmp_path: Path) -> None:
    """A PD pair, a colocated worker serving pulls, KV events and a metrics port: every one
    of their listening sockets is bound to 127.0.0.1, none to a wildcard."""
    events, boot, metrics = free_port(), free_port(), free_port()
    pd = ["--disaggregation-timeout-secs", "20", "--mempool-secret", "s"]
    prefill = sim(model_dir, "--disaggregation-mode", "prefill", *pd)
    prefill += ["--disaggregation-bootstrap-port", str(boot)]
    decode = sim(model_dir, "--disaggregation-mode", "decode", *pd)
    pull_port = free_port()
    colocated_url = f"http://127.0.0.1:{pull_port}"
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}", "topic": colocated_url}
    colocated = sim(model_dir, "--enable-mempool-pull", "--mempool-secret", "s")
    colocated += ["--kv-events-config", json.dumps(config)]
    with (
        running("connector.worker", prefill, tmp_path) as p,
        running("connector.worker", decode, tmp_path) as d,
        running("connector.worker", colocated, tmp_path, port=pull_port) as c,
        running(
            "router",
            ["--pd-disaggregation", "--prefill", p.url, str(boot), "--decode", d.url]
            + ["--prometheus-port", str(metrics)],
            tmp_path,
        ) as pd_router,
        running(
            "router",
            ["--worker-urls", c.url, "--kv-events-bind", f"tcp://127.0.0.1:{events}"],
            tmp_path,
        ) as router,
    ):
        # one request each way, so lazily opened sockets (agents, transfers) exist
        answer = post(pd_router.url + "/generate", {"text": "hello there"})
        assert answer[0] == 200, answer
        assert post(router.url + "/generate", {"text": "hello there"})[0] == 200
        servers: list[Server] = [p, d, c, pd_router, router]
        bound = {s.name + str(s.port): listening(s.proc.pid) for s in servers}
    assert all(bound.values()), bound  # each one listens somewhere
    ports = {port for addresses in bound.values() for _, port in addresses}
    assert {boot, metrics} <= ports
    wide = {name: a for name, a in bound.items() if any(h != "127.0.0.1" for h, _ in a)}
    assert not wide, wide

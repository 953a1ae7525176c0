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

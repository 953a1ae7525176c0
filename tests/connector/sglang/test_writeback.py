"""MemServe's PD-Caching-3 on SGLang's storage interface: a decode server (its own process)
stores a finished request's pages and pushes them to the prefill server's MemPool over real
sockets; the prefill's next turn finds them through SGLang's hit query and reads them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from connector.sglang.backend import MemPoolStorage
from connector.sglang.cpu_paths import Controller
from localrun.processes import free_port
from tests.connector.sglang.helpers import (
    PAGE,
    create,
    extra,
    host_pool,
    indices,
    keys_of,
    page_digest,
)

ROOT = Path(__file__).resolve().parents[3]


def run_decode(config: dict[str, Any], tokens: list[int], seed: int) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.connector.sglang.decode_server",
            json.dumps(config),
            json.dumps(tokens),
            str(seed),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def listen_port(backend: MemPoolStorage) -> int:
    return int(backend.stats()["listen"].rsplit(":", 1)[1])


def test_decode_pages_reach_the_prefill_and_the_next_turn_reuses_them() -> None:
    seed = 7
    prompt = list(range(2000, 2000 + 3 * PAGE))  # turn 1's prompt: 3 pages
    output = list(range(9000, 9000 + 2 * PAGE + 1))  # decoded: 2 more pages and a partial one
    prefill_host = host_pool(seed=seed)  # same seed: the same KV for the same positions
    prefill = create(extra(mempool_instance_id=1), prefill_host)
    try:
        ctl = Controller(prefill, prefill_host)
        assert ctl.backup(indices(3), keys_of(prompt)) == 3 * PAGE  # the prefill's own pages
        peer = f"1@127.0.0.1:{listen_port(prefill)}"
        decode = run_decode(
            extra(mempool_instance_id=2, mempool_writeback_peers=[peer]), prompt + output, seed
        )
        assert decode["written_tokens"] == 5 * PAGE
        wb = decode["writeback"]
        # incremental: the prompt's pages were there; only the decoded ones travelled
        assert (wb["pages_sent"], wb["pages_skipped"], wb["failures"]) == (2, 3, 0), wb
        assert wb["bytes"] == 2 * prefill.stats()["tiers"]["host"]["block_bytes"]

        turn2 = prompt + output + list(range(5000, 5000 + 2 * PAGE))
        assert prefill.batch_exists(keys_of(turn2)) == 5
        hit, pages = ctl.prefetch(turn2, indices(7, first_page=20))
        assert (hit, pages) == (5 * PAGE, 5)  # prompt and decode output, 2 new pages missed
        got = [page_digest(prefill_host, (20 + i) * PAGE) for i in range(5)]
        assert got == decode["digests"]
        assert prefill.stats()["tiers"]["host"]["used"] == 5
    finally:
        prefill.close()


def test_without_writeback_the_prefill_misses_the_decoded_pages() -> None:
    """The control: PD-Caching-2 (decode caches locally only) gives the prefill nothing."""
    prompt = list(range(2000, 2000 + 3 * PAGE))
    output = list(range(9000, 9000 + 2 * PAGE))
    prefill_host = host_pool(seed=7)
    prefill = create(extra(mempool_instance_id=1), prefill_host)
    try:
        Controller(prefill, prefill_host).backup(indices(3), keys_of(prompt))
        decode = run_decode(extra(mempool_instance_id=2), prompt + output, 7)
        assert decode["writeback"]["pages_sent"] == 0
        assert prefill.batch_exists(keys_of(prompt + output)) == 3
    finally:
        prefill.close()


def test_an_unreachable_prefill_fails_the_writeback_not_the_store() -> None:
    port = free_port()  # nothing listens there
    host = host_pool(seed=1)
    decode = create(
        extra(
            mempool_instance_id=2,
            mempool_writeback_peers=f"1@127.0.0.1:{port}",
            mempool_timeout_s=2,
        ),
        host,
    )
    try:
        keys = keys_of(list(range(0, 2 * PAGE)))
        assert decode.batch_set_v1(keys, indices(2)) == [True, True]
        wb = decode.drain(30)
        assert wb.failures == 2 and wb.pages_sent == 0
        assert f"writeback to instance 1 (127.0.0.1:{port}) failed" in wb.errors[-1]
        assert decode.batch_exists(keys) == 2  # stored locally all the same
        assert decode.stats()["protected_pages"] == 0  # pins released
    finally:
        decode.close()


def test_a_peer_with_another_page_size_is_refused() -> None:
    prefill = create(extra(mempool_instance_id=1), host_pool(page=8))
    peer = f"1@127.0.0.1:{listen_port(prefill)}"
    decode = create(extra(mempool_instance_id=2, mempool_writeback_peers=[peer]), host_pool(seed=1))
    try:
        keys = keys_of(list(range(0, PAGE)))
        decode.batch_set_v1(keys, indices(1))
        wb = decode.drain(30)
        assert wb.failures == 1 and wb.pages_sent == 0
        assert "writeback to instance 1" in wb.errors[-1]
        assert prefill.batch_exists(keys) == 0
    finally:
        decode.close()
        prefill.close()


@pytest.mark.parametrize("secret", ["right", "wrong"])
def test_peers_authenticate_with_the_shared_secret(secret: str) -> None:
    prefill = create(extra(mempool_instance_id=1, mempool_secret="right"), host_pool())
    peer = f"1@127.0.0.1:{listen_port(prefill)}"
    decode = create(
        extra(
            mempool_instance_id=2,
            mempool_writeback_peers=[peer],
            mempool_secret=secret,
            mempool_timeout_s=2,
        ),
        host_pool(seed=1),
    )
    try:
        keys = keys_of(list(range(0, PAGE)))
        decode.batch_set_v1(keys, indices(1))
        wb = decode.drain(30)
        assert (wb.pages_sent, wb.failures) == ((1, 0) if secret == "right" else (0, 1))
        assert prefill.batch_exists(keys) == (1 if secret == "right" else 0)
    finally:
        decode.close()
        prefill.close()

"""A PD prefill pulls a longer prefix from another prefill before it computes (2P1D, sim).

Real sim workers on loopback: two prefills with --enable-mempool-pull (their pulls go through
the MemPool agent their PD transfers use) and one decode, PD-Caching-1. Prefill A computes a
prompt; the same prompt plus a new tail then goes to prefill B with the router's hint naming
A. B pulls the pages it lacks from A, computes only the tail, pushes the whole prompt's KV to
the decode, and the decode's answer (the one a client reads) reports the pulled tokens apart
from the cached ones. Nothing stays pinned or leaks on any of the three.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.connector.test_worker_pull_sim import SECRET, TIMEOUT, cached_after, hint, pull_stats
from tests.connector.test_worker_sim_pd import (
    both,
    info,
    no_leak,
    prompt_ids,
    sim_args,
    wait_for,
    with_room,
)
from tests.http_client import call
from tests.procs import ROOT, Server, free_port, running
from tests.router.test_tiers_and_pulls import reasons

PULLS = ["--enable-mempool-pull", "--mempool-secret", SECRET]
PULLS += ["--mempool-pull-timeout-secs", str(TIMEOUT)]
TIMEOUT_ARGS = ["--disaggregation-timeout-secs", "20"]


def prefill_args(model_dir: Path, boot: int, time_scale: str, caching: str) -> list[str]:
    role = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)]
    pd = ["--pd-caching", caching, *TIMEOUT_ARGS]
    return sim_args(model_dir, *role, *pd, *PULLS, time_scale=time_scale)


Cluster = tuple[Server, int, Server, int, Server]


@contextlib.contextmanager
def two_prefills(
    model_dir: Path, log_dir: Path, time_scale: str = "0", caching: str = "caching-1"
) -> Iterator[Cluster]:
    """Prefills A and B (each with its bootstrap port) and one decode; with a time scale of
    0 the modelled time is not slept."""
    boot_a, boot_b = free_port(), free_port()
    decode = ["--disaggregation-mode", "decode", "--pd-caching", caching, *TIMEOUT_ARGS]
    decode += ["--mempool-secret", SECRET]
    with (
        running(
            "connector.worker", prefill_args(model_dir, boot_a, time_scale, caching), log_dir
        ) as a,
        running(
            "connector.worker", prefill_args(model_dir, boot_b, time_scale, caching), log_dir
        ) as b,
        running(
            "connector.worker", sim_args(model_dir, *decode, time_scale=time_scale), log_dir
        ) as d,
    ):
        yield a, boot_a, b, boot_b, d


def pd_generate(
    prefill: Server, boot: int, decode: Server, ids: list[int], **extra: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6}, **extra}
    (ps, pb), (ds, db) = both(prefill, decode, "/generate", with_room(body, boot))
    assert ps == 200, pb
    assert ds == 200, db
    return pb, db


def test_a_prefill_pulls_a_prefix_from_another_prefill_and_the_answer_says_so(
    model_dir: Path, tmp_path: Path
) -> None:
    with two_prefills(model_dir, tmp_path) as (a, boot_a, b, boot_b, d):
        assert info(b)["memserve"]["kv_pull"] is True
        agent_a = info(a)["memserve"]["agent"]
        # the pulls' agent is the PD agent: one per instance
        assert agent_a["port"] == info(a)["disaggregation"]["agent"]["port"]
        history = prompt_ids(1, 1000)
        _, first = pd_generate(a, boot_a, d, history)
        assert first["meta_info"]["pulled_tokens"] == 0
        held = 1000 // 16 * 16  # a caching-1 prefill caches the prompt's whole pages

        turn = history + prompt_ids(2, 80)
        pre, dec = pd_generate(b, boot_b, d, turn, memserve=hint(a, held))
        for answer in (pre, dec):  # the prefill's answer and the decode's alike
            assert answer["meta_info"]["pulled_tokens"] == held, answer["meta_info"]
            assert answer["meta_info"]["cached_tokens"] == 0
        assert pull_stats(b)["pulls"] == 1 and pull_stats(a)["served"] == 1
        # the same turn again on B: its own cache now, nothing pulled, the same tokens
        _, dec2 = pd_generate(b, boot_b, d, turn, memserve=hint(a, held))
        assert dec2["meta_info"]["pulled_tokens"] == 0
        assert dec2["meta_info"]["cached_tokens"] == cached_after(len(turn), 1)
        assert dec2["output_ids"] == dec["output_ids"]
        assert pull_stats(b)["pulls"] == 1
        for worker in (a, b, d):
            no_leak(worker)
        assert info(a)["mempool"]["protected_pages"] == 0


@pytest.mark.parametrize("caching", ["caching-2", "caching-3"])
def test_a_prefill_pulls_a_prefix_a_decode_keeps(
    model_dir: Path, tmp_path: Path, caching: str
) -> None:
    """PD-Caching-2/3: the decode caches every prompt it receives and serves it to pulls (it
    does not pull itself); prefill B gets A's prompt from the decode."""
    with two_prefills(model_dir, tmp_path, caching=caching) as (a, boot_a, b, boot_b, d):
        memserve = info(d)["memserve"]
        assert memserve["serves_pulls"] is True and memserve["kv_pull"] is False
        assert info(a)["memserve"]["serves_pulls"] is True  # a prefill that pulls serves too
        history = prompt_ids(6, 1000)
        pd_generate(a, boot_a, d, history)
        held = 1000 // 16 * 16
        named = {"prefix_holders": [{"url": d.url, "cached_tokens": held, **memserve["agent"]}]}
        turn = history + prompt_ids(7, 50)
        _, dec = pd_generate(b, boot_b, d, turn, memserve=named)
        assert dec["meta_info"]["pulled_tokens"] == held, dec["meta_info"]
        assert pull_stats(b)["pulls"] == 1 and pull_stats(d)["served"] == 1
        for worker in (a, b, d):
            wait_for(f"{worker.url} settled", settled(worker))
            no_leak(worker)


def settled(worker: Server) -> Callable[[], bool]:
    """Nothing pinned on it: its transfers and write-backs are over."""
    return lambda: info(worker)["mempool"]["protected_pages"] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--disaggregation-mode", "decode"), "a decode instance does not pull"),
        (
            ("--disaggregation-mode", "prefill", "--pd-caching", "basic"),
            "needs a --pd-caching mode in which it caches",
        ),
        (
            ("--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"),
            "needs --disaggregation-transfer-backend mempool",
        ),
    ],
)
def test_pd_pull_flags_that_cannot_work_are_a_one_line_start_error(
    model_dir: Path, extra: tuple[str, ...], message: str
) -> None:
    cmd = [sys.executable, "-m", "connector.worker", "--port", str(free_port())]
    cmd += sim_args(model_dir, *PULLS, *extra)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr


def router_args(a: Server, boot_a: int, b: Server, boot_b: int, d: Server) -> list[str]:
    """prompt-tree in PD; any difference in load counts as an imbalance (sglang-router's
    thresholds at their most eager), so a busy holder's prefix moves."""
    args = ["--policy", "prompt-tree", "--pd-disaggregation", "--pd-caching", "caching-1"]
    args += ["--prefill", a.url, str(boot_a), "--prefill", b.url, str(boot_b)]
    args += ["--decode", d.url, "--health-check-interval-secs", "0.2"]
    return args + ["--balance-abs-threshold", "0", "--balance-rel-threshold", "1"]


def test_the_router_names_a_busy_prefills_prefix_to_the_prefill_it_picks_instead(
    model_dir: Path, tmp_path: Path
) -> None:
    with (
        two_prefills(model_dir, tmp_path, time_scale="1") as (a, boot_a, b, boot_b, d),
        running("router", router_args(a, boot_a, b, boot_b, d), tmp_path) as r,
    ):
        history = prompt_ids(3, 1000)
        body = {"input_ids": history, "sampling_params": {"max_new_tokens": 4}}
        status, first = call(r.url + "/generate", body)
        assert status == 200, first
        holder, other = (a, b) if info(a)["mempool"]["cached_tokens"] else (b, a)
        assert info(holder)["mempool"]["cached_tokens"] == 992
        assert info(other)["mempool"]["cached_tokens"] == 0

        # the holder busy with a long request of its own (sent to it directly)
        slow = {"input_ids": prompt_ids(4, 6000), "sampling_params": {"max_new_tokens": 400}}
        with ThreadPoolExecutor(1) as pool:
            busy = pool.submit(call, holder.url + "/generate", slow)

            def holder_busy() -> bool:
                loads = call(r.url + "/get_loads")[1]["workers"]
                return any(w["worker"] == holder.url and w["load"] > 0 for w in loads)

            wait_for("the router sees the holder busy", holder_busy, timeout=10)
            turn = history + prompt_ids(5, 60)
            body = {"input_ids": turn, "sampling_params": {"max_new_tokens": 4}}
            status, answer = call(r.url + "/generate", body)
            assert busy.result()[0] == 200
        assert status == 200, answer
        assert answer["meta_info"]["pulled_tokens"] == 992, answer["meta_info"]
        assert pull_stats(other)["pulls"] == 1 and pull_stats(holder)["served"] == 1
        decided = reasons(r.url)
        moved = {k: v for k, v in decided.items() if k.startswith("prefill_overload")}
        assert sum(moved.values()) == 1, decided
        assert decided.get("prefill_cache_miss") == 1, decided  # the first request's prefill

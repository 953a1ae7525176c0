"""Faults in a disaggregated deployment: a decode instance killed while the prompt's KV is
on the wire to it, and a prefill instance killed right after it handed the KV off.

Sim prefill and decode workers (PD-Caching-3) behind a router in PD mode; KV moves through
MemPool transfer agents over loopback TCP, its modelled wire time slept.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.reliability.client import Tally, post
from benchmarks.reliability.cluster import Cluster, PoolCount, get_json, settled_leak
from benchmarks.reliability.faults import BOUND_S, Settings, finish, heal, tally_into
from benchmarks.reliability.report import FaultResult
from localrun.processes import Server, free_port

PD_TIMEOUT_S = "20"  # --disaggregation-timeout-secs


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def pd_cluster(
    c: Cluster, decodes: int, *extra: str, time_scale: float, decode_extra: Sequence[str] = ()
) -> tuple[Server, Server, list[Server]]:
    """One prefill, `decodes` decode workers (with `decode_extra` flags too) and a router in
    PD mode; (router, prefill, decodes)."""
    boot = free_port()
    common = ["--pd-caching", "caching-3", "--disaggregation-timeout-secs", PD_TIMEOUT_S, *extra]
    prefill = c.worker_launch(
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(boot),
        *common,
        time_scale=time_scale,
    )
    decode = [
        c.worker_launch(
            "--disaggregation-mode", "decode", *common, *decode_extra, time_scale=time_scale
        )
        for _ in range(decodes)
    ]
    servers = c.start([prefill, *decode])
    args = ["--policy", "round_robin", "--prefill", servers[0].url, str(boot)]
    for d in servers[1:]:
        args += ["--decode", d.url]
    router = c.router([*args, "--pd-caching", "caching-3"])
    return router, servers[0], servers[1:]


def later_pd(router: Server, n: int = 4) -> Tally:
    """PD requests once the fault is over: every one must be answered."""
    bodies = [
        {"input_ids": ids(500 + i, 100), "sampling_params": {"max_new_tokens": 20}}
        for i in range(n)
    ]
    return Tally([post(router.url + "/generate", body, BOUND_S) for body in bodies])


def heal_pd(c: Cluster, router: Server, broken: Server, result: FaultResult) -> Server:
    return heal(c, router, broken, result, later_pd, "later PD requests")


def decode_killed_mid_transfer(c: Cluster, s: Settings) -> FaultResult:
    """1 prefill + 2 decodes; 20 pages on a 0.1 Gb/s modelled link keep the transfer on the
    wire for seconds. The decode receiving it is SIGKILLed once its blocks are allocated:
    the router retries the pair with the other decode."""
    r = FaultResult(
        "decode killed during the KV transfer",
        "SIGKILL to the decode instance while the prompt's KV was on the wire to it (1P2D)",
        bound_s=BOUND_S,
        expected="the request retried with the other decode and answered; the prefill "
        "frees what it held for the dead decode",
    )
    router, prefill, decodes = pd_cluster(c, 2, "--sim-interconnect-gbps", "0.1", time_scale=1.0)
    n = 310
    body = {"input_ids": ids(9, n), "sampling_params": {"max_new_tokens": 16}}
    base = {d.url: PoolCount.of(d).used for d in decodes}
    victim: Server | None = None
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post, router.url + "/generate", body, BOUND_S)
        deadline = time.monotonic() + 15
        while victim is None and time.monotonic() < deadline and not future.done():
            for d in decodes:
                if PoolCount.of(d).used - base[d.url] >= -(-n // 16):
                    victim = d
                    break
            time.sleep(0.05)
        if victim is not None:
            c.kill(victim)
        seen = future.result()
    if victim is None:
        r.error = "the transfer was never caught in flight"
        return r
    tally = Tally([seen])
    tally_into(r, tally)
    stats: dict[str, Any] = get_json(prefill.url + "/get_server_info")["disaggregation"]
    r.client_saw = f"{seen.summary()} after {seen.seconds:.1f} s"
    r.notes.append(f"prefill transfer failures: {stats.get('failures')}.")
    r.expectation_met = seen.ok
    survivors = [prefill, *(d for d in decodes if d is not victim)]
    fresh = heal_pd(c, router, victim, r)
    return finish(r, [*survivors, fresh])


def prefill_killed_after_handoff(c: Cluster, s: Settings) -> FaultResult:
    """The decode has the KV and is streaming; the prefill is SIGKILLed. The answer must
    complete; the decode's PD-Caching-3 write-back to the dead prefill fails and must
    release what it pinned."""
    r = FaultResult(
        "prefill killed after the hand-off",
        "SIGKILL to the prefill instance once the decode began streaming (1P1D, caching-3)",
        bound_s=BOUND_S,
        expected="the stream completes; the decode's write-back fails without leaking",
    )
    router, prefill, (decode,) = pd_cluster(c, 1, time_scale=1.0)
    body = {"input_ids": ids(11, 300), "stream": True, "sampling_params": {"max_new_tokens": 400}}

    def on_event(n: int) -> None:
        if n == 2:
            c.kill(prefill)

    seen = post(router.url + "/generate", body, BOUND_S, on_event=on_event)
    tally_into(r, Tally([seen]))
    time.sleep(1.0)  # the write-back runs after the answer
    stats = get_json(decode.url + "/get_server_info")["disaggregation"]
    r.client_saw = f"stream: {seen.summary()}, {seen.events} events, [DONE]={seen.done}"
    r.notes.append(
        f"decode write-backs done {stats.get('written_back')}, failures {stats.get('failures')}."
    )
    r.expectation_met = seen.ok and seen.done and prefill.exited() is not None
    leaked_decode = settled_leak([decode])
    fresh = heal_pd(c, router, prefill, r)
    finish(r, [decode, fresh])
    if any(leaked_decode.values()):
        r.leaked_blocks += sum(leaked_decode.values())
        r.notes.append(f"decode held {leaked_decode} before the prefill came back.")
    return r


SCENARIOS = [decode_killed_mid_transfer, prefill_killed_after_handoff]

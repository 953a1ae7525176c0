"""Faults in front of colocated workers (killed before, during and after a request, hung,
flapping, the router restarted) and in a PD pair (a decode killed mid-transfer, a prefill
killed after its hand-off): each on its own processes, with what the client saw, the slowest
request, the blocks left held on the survivors and whether the pool healed."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.reliability.client import Seen, Tally, post, until_answered
from benchmarks.reliability.cluster import Cluster, PoolCount, get_json, metric, settled_leak
from benchmarks.reliability.report import BOUND_S, FaultResult
from localrun.processes import Server

HANG_BOUND_S = 10.0  # a hung worker's requests must end well before it wakes (FROZEN_S)
FROZEN_S = 15.0
FLAP_DOWN_S = 4.0  # long enough for 2 failed probes (0.5 s apart, 1 s timeout)
FLAP_UP_S = 3.0
SYSTEM = "You are a careful assistant for a shipping company; cite the policy section. " * 8
CHAT = "/v1/chat/completions"
STORY = "Tell me a very long story about parcels."


@dataclass(frozen=True)
class Settings:
    """How hard a run pushes (the quick preset: fewer requests and flaps)."""

    requests: int = 8
    flaps: int = 3
    load_threads: int = 3


Scenario = Callable[[Cluster, Settings], FaultResult]


def chat(n: int, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Parcel {n}?"}]
    return {"messages": messages, "max_tokens": max_tokens, "stream": stream}


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


def served(router: Server) -> dict[str, int]:
    return {w["url"]: w["processed"] for w in get_json(router.url + "/workers")["workers"]}


def holding(
    c: Cluster, first: dict[str, Any], time_scale: float = 0.02
) -> tuple[list[Server], Server, Seen, Server]:
    """Two workers behind a fresh router, the answer to `first`, and the worker that served
    it (it holds the conversation's prefix now)."""
    workers = c.workers(2, time_scale=time_scale)
    router = c.colocated_router(workers)
    before = served(router)
    seen = post(router.url + CHAT, first, BOUND_S)
    after = served(router)
    url = max(after, key=lambda u: after[u] - before.get(u, 0))
    return workers, router, seen, next(w for w in workers if w.url == url)


def tally_into(result: FaultResult, tally: Tally) -> None:
    result.requests += len(tally)
    result.answered += tally.ok
    result.clear_errors += tally.clear_errors
    result.unclear += len(tally.unclear)
    result.slowest_s = max(result.slowest_s, tally.slowest_s)
    for bad in tally.unclear[:3]:
        result.notes.append(f"unclear: {bad.summary()}.")


def later_chats(router: Server, n: int = 4) -> Tally:
    """Requests once the fault is over: every one must be answered."""
    return Tally([post(router.url + CHAT, chat(1000 + i), BOUND_S) for i in range(n)])


def later_pd(router: Server) -> Tally:
    bodies = [
        {"input_ids": ids(500 + i, 100), "sampling_params": {"max_new_tokens": 20}}
        for i in range(4)
    ]
    return Tally([post(router.url + "/generate", body, BOUND_S) for body in bodies])


def healed_after(
    result: FaultResult, ok: bool, how: str, later: Tally, what: str = "later requests"
) -> None:
    """Counts `later` (sent once the fault was over): healed when `ok` and all answered."""
    tally_into(result, later)
    result.healed = ok and later.ok == len(later)
    result.healed_how = f"{how}, {later.ok}/{len(later)} {what} answered"


def heal(
    c: Cluster, router: Server, broken: Server, result: FaultResult, pd: bool = False
) -> Server:
    """Healed: the router saw `broken` unhealthy, then healthy once restarted, and later
    requests (PD ones with `pd`) were answered; the restarted server."""
    down = c.wait_health(router, broken.url, healthy=False)
    fresh = c.restart(broken)
    up = c.wait_health(router, fresh.url, healthy=True)
    how = (
        f"marked unhealthy in {down:.1f} s" if down is not None else "never marked unhealthy"
    ) + (f", healthy {up:.1f} s after restart" if up is not None else ", never healthy again")
    later, what = (later_pd, "later PD requests") if pd else (later_chats, "later requests")
    healed_after(result, down is not None and up is not None, how, later(router), what)
    return fresh


def finish(result: FaultResult, workers: list[Server]) -> FaultResult:
    leaked = settled_leak(workers)
    result.leaked_blocks = -1 if -1 in leaked.values() else sum(leaked.values())
    if result.leaked_blocks:
        result.notes.append(f"leaked per worker: {leaked}.")
    return result


def killed_before_request(c: Cluster, s: Settings) -> FaultResult:
    """The prefix's worker SIGKILLed before the router noticed: it retries elsewhere."""
    r = FaultResult(
        "worker killed before the request",
        "SIGKILL to the worker holding the conversation's prefix, just before its next turns",
        expected="every turn answered: the router retries on the other worker",
    )
    workers, router, warm, holder = holding(c, chat(1))
    c.kill(holder)
    retried = metric(router, "sgl_router_retries_total")
    tally = Tally(
        post(router.url + CHAT, chat(1 if i % 2 else i), BOUND_S) for i in range(s.requests)
    )
    tally_into(r, tally)
    retried = metric(router, "sgl_router_retries_total") - retried
    r.client_saw = f"{tally.statuses()}; router retries {retried:.0f}"
    r.expectation_met = warm.ok and tally.ok == len(tally)
    fresh = heal(c, router, holder, r)
    return finish(r, [*(w for w in workers if w is not holder), fresh])


def kill_busy(c: Cluster, workers: list[Server]) -> Server | None:
    """SIGKILL the worker that is generating now (its /get_load counts a request)."""
    busy = [w for w in workers if get_json(w.url + "/get_load")[0]["num_reqs"] > 0]
    if busy:
        c.kill(busy[0])
    return busy[0] if busy else None


def kill_while(c: Cluster, streamed: bool) -> tuple[Seen, list[Server], Server | None, Server]:
    """A long /generate on two fresh workers, the busy one killed after the 5th event
    (streamed) or about a second in."""
    workers = c.workers(2, time_scale=1.0)
    router = c.colocated_router(workers)
    sampling = {"max_new_tokens": 3000 if streamed else 800}
    body = {"text": STORY, "stream": streamed, "sampling_params": sampling}
    victim: list[Server | None] = []
    if streamed:

        def on_event(n: int) -> None:
            if n == 5:
                victim.append(kill_busy(c, workers))

        seen = post(router.url + "/generate", body, BOUND_S, on_event=on_event)
        return seen, workers, (victim[0] if victim else None), router
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post, router.url + "/generate", body, BOUND_S)
        deadline = time.monotonic() + 10
        while not (victim and victim[-1]) and time.monotonic() < deadline:
            time.sleep(0.3)
            victim.append(kill_busy(c, workers))
        seen = future.result()
    return seen, workers, victim[-1] if victim else None, router


def killed_mid_request(c: Cluster, s: Settings) -> FaultResult:
    """SIGKILL while generating: a stream (already begun) ends with an error event and
    [DONE]; a non-streamed answer is retried on the other worker."""
    r = FaultResult(
        "worker killed mid-request",
        "SIGKILL to a worker streaming a long answer, and to one generating a non-streamed one",
        expected="the stream ends with an error event and [DONE]; the non-streamed request "
        "is retried elsewhere and answered",
    )
    tally = Tally()
    survivors: list[Server] = []
    for streamed in (True, False):
        seen, workers, victim, router = kill_while(c, streamed)
        tally.append(seen)
        r.expectation_met &= (seen.status == 200 and seen.clear_error) if streamed else seen.ok
        if victim is None:
            r.error = "no worker was busy to kill"
            return r
        survivors += [w for w in workers if w is not victim]
        if streamed:
            survivors.append(heal(c, router, victim, r))
    tally_into(r, tally)
    r.client_saw = f"stream: {tally[0].summary()}; non-streamed: {tally[1].summary()}"
    return finish(r, survivors)


def killed_after_answer(c: Cluster, s: Settings) -> FaultResult:
    """The worker dies after its whole streamed answer: the next turn (the tree says the
    dead worker holds it) is retried on the other worker."""
    r = FaultResult(
        "worker killed after streaming",
        "SIGKILL to the worker right after its streamed answer ended",
        expected="the stream complete; the next turn retried elsewhere and answered",
    )
    workers, router, first, holder = holding(c, chat(7, stream=True))
    c.kill(holder)
    tally = Tally(
        [first, *(post(router.url + CHAT, chat(7), BOUND_S) for _ in range(s.requests // 2))]
    )
    tally_into(r, tally)
    r.client_saw = (
        f"stream: {first.summary()} with [DONE]={first.done}; next turns {tally.statuses()}"
    )
    r.expectation_met = first.ok and first.done and tally.ok == len(tally)
    fresh = heal(c, router, holder, r)
    return finish(r, [*(w for w in workers if w is not holder), fresh])


def hangs(c: Cluster, s: Settings) -> FaultResult:
    """SIGSTOP: requests not yet begun go elsewhere once health checks fail, the stream in
    flight ends with an error event; SIGCONT heals it."""
    r = FaultResult(
        "worker hangs (accepts, never answers)",
        "SIGSTOP to the worker holding the prefix, with a stream in flight and new turns "
        f"arriving; SIGCONT {FROZEN_S:.0f} s later",
        bound_s=HANG_BOUND_S,
        expected="new turns answered by the other worker once health checks fail; the "
        "stream in flight ends with an error event",
    )
    workers, router, _, holder = holding(c, chat(3), time_scale=0.5)
    frozen = threading.Event()
    streamed: list[Seen] = []

    def stream_then_freeze() -> None:
        def on_event(n: int) -> None:
            if n == 3:
                c.freeze(holder)
                frozen.set()

        body = chat(3, max_tokens=2000, stream=True)
        streamed.append(post(router.url + CHAT, body, HANG_BOUND_S, on_event=on_event))

    thread = threading.Thread(target=stream_then_freeze)
    thread.start()
    frozen.wait(BOUND_S)
    tally = Tally()
    with ThreadPoolExecutor(s.requests) as pool:
        futures = [
            pool.submit(post, router.url + CHAT, chat(3), HANG_BOUND_S) for _ in range(s.requests)
        ]
        time.sleep(FROZEN_S)
        c.thaw(holder)
        for f in futures:
            tally.append(f.result())
    thread.join()
    stream = streamed[0] if streamed else Seen(error="the stream never ran")
    tally.append(stream)
    tally_into(r, tally)
    r.client_saw = f"new turns {Tally(tally[:-1]).statuses()}; stream: {stream.summary()}"
    r.expectation_met = tally.ok == len(tally) - 1 and stream.clear_error
    up = c.wait_health(router, holder.url, healthy=True)
    later = later_chats(router)
    how = f"healthy {up:.1f} s after SIGCONT" if up is not None else "never healthy again"
    healed_after(r, up is not None and all(c.router_view(router).values()), how, later)
    return finish(r, workers)


@contextlib.contextmanager
def under_load(threads: int, send: Callable[[int, int], Seen]) -> Iterator[Tally]:
    """`threads` clients calling `send(client, i)` for i = 1, 2, ... until the block ends;
    the Tally yielded holds their outcomes once it has ended."""
    stop = threading.Event()
    tally = Tally()

    def client(k: int) -> list[Seen]:
        seen, i = [], 0
        while not stop.is_set():
            i += 1
            seen.append(send(k, i))
        return seen

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(client, k) for k in range(threads)]
        try:
            yield tally
        finally:  # (a fault that fails must not leave the clients sending forever)
            stop.set()
        tally += [seen for f in futures for seen in f.result()]


def flapping(c: Cluster, s: Settings) -> FaultResult:
    """A worker stopped and continued over and over under load: taken out and back each time."""
    r = FaultResult(
        "health flapping",
        f"SIGSTOP {FLAP_DOWN_S:.0f} s / SIGCONT {FLAP_UP_S:.0f} s, {s.flaps} times, on one "
        "worker under steady load",
        expected="every request answered (sent elsewhere or retried) or a clear error",
    )
    workers = c.workers(2)
    router = c.colocated_router(workers)
    victim = workers[0]
    watching = threading.Event()
    transitions: list[tuple[float, bool]] = []

    def watch() -> None:
        last = True
        while not watching.is_set():
            try:
                now = c.router_view(router).get(victim.url, True)
            except (OSError, ValueError):
                now = last
            if now != last:
                transitions.append((time.monotonic(), now))
                last = now
            time.sleep(0.1)

    def send(k: int, i: int) -> Seen:
        seen = post(router.url + CHAT, chat(k * 1000 + i), BOUND_S)
        time.sleep(0.05)  # a client's think time
        return seen

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with under_load(s.load_threads, send) as tally:
            for _ in range(s.flaps):
                time.sleep(FLAP_UP_S)
                c.freeze(victim)
                time.sleep(FLAP_DOWN_S)
                c.thaw(victim)
            time.sleep(1.0)
    finally:
        watching.set()
        watcher.join()
    tally_into(r, tally)
    downs = sum(1 for _, up in transitions if not up)
    r.client_saw = f"{tally.statuses()}; worker marked down {downs} times"
    r.expectation_met = not tally.unclear and tally.ok > 0
    up = c.wait_health(router, victim.url, healthy=True)
    before = served(router)[victim.url]
    how = f"taken out {downs} times and back each time" if up is not None else "stuck out"
    healed_after(r, up is not None and downs == s.flaps, how, later_chats(router, n=6))
    r.notes.append(
        f"the flapping worker served {served(router)[victim.url] - before} of the later ones."
    )
    return finish(r, workers)


def router_restarted(c: Cluster, s: Settings) -> FaultResult:
    """The router SIGKILLed under load and restarted on its port: clients send again; the
    workers keep nothing of what it left running."""
    r = FaultResult(
        "router restarted under load",
        f"SIGKILL to the router with {s.load_threads} clients sending, restarted on its port",
        expected="requests cut by the restart fail at the transport; the client's retry "
        "after the restart is answered",
    )
    workers = c.workers(2, time_scale=0.2)
    router = c.colocated_router(workers)
    url = router.url  # the restarted router serves on the same port

    def send(k: int, i: int) -> Seen:
        body = chat(k * 1000 + i, max_tokens=40, stream=bool(i % 2))
        return until_answered(url + CHAT, body, BOUND_S, BOUND_S)

    with under_load(s.load_threads, send) as tally:
        time.sleep(2.0)
        c.kill(router)
        time.sleep(0.5)
        router = c.restart(router)
        time.sleep(2.0)
    tally_into(r, tally)
    retried = [seen for seen in tally if seen.attempts > 1]
    r.client_saw = (
        f"{tally.statuses()}; {len(retried)} requests needed the client to send again, "
        f"{sum(x.ok for x in retried)} of them then answered"
    )
    r.expectation_met = tally.ok == len(tally) and bool(retried)
    later = later_chats(router)
    view = c.router_view(router)
    how = f"restarted router sees {sum(view.values())}/{len(view)} workers healthy"
    healed_after(r, all(view.values()), how, later)
    return finish(r, workers)


def decode_killed_mid_transfer(c: Cluster, s: Settings) -> FaultResult:
    """1P2D, 20 pages on a 0.1 Gb/s modelled link: the receiving decode SIGKILLed once its
    blocks are allocated; the router retries the pair with the other decode."""
    r = FaultResult(
        "decode killed during the KV transfer",
        "SIGKILL to the decode instance while the prompt's KV was on the wire to it (1P2D)",
        expected="the request retried with the other decode and answered; the prefill "
        "frees what it held for the dead decode",
    )
    router, prefill, decodes = c.pd(2, "--sim-interconnect-gbps", "0.1", time_scale=1.0)
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
    tally_into(r, Tally([seen]))
    stats: dict[str, Any] = get_json(prefill.url + "/get_server_info")["disaggregation"]
    r.client_saw = f"{seen.summary()} after {seen.seconds:.1f} s"
    r.notes.append(f"prefill transfer failures: {stats.get('failures')}.")
    r.expectation_met = seen.ok
    survivors = [prefill, *(d for d in decodes if d is not victim)]
    return finish(r, [*survivors, heal(c, router, victim, r, pd=True)])


def prefill_killed_after_handoff(c: Cluster, s: Settings) -> FaultResult:
    """The prefill SIGKILLed while the decode streams: the answer completes, and the
    decode's failed caching-3 write-back releases what it pinned."""
    r = FaultResult(
        "prefill killed after the hand-off",
        "SIGKILL to the prefill instance once the decode began streaming (1P1D, caching-3)",
        expected="the stream completes; the decode's write-back fails without leaking",
    )
    router, prefill, (decode,) = c.pd(1, time_scale=1.0)
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
    finish(r, [decode, heal(c, router, prefill, r, pd=True)])
    if any(leaked_decode.values()):
        r.leaked_blocks += sum(leaked_decode.values())
        r.notes.append(f"decode held {leaked_decode} before the prefill came back.")
    return r


SCENARIOS: list[Scenario] = [
    killed_before_request,
    killed_mid_request,
    killed_after_answer,
    hangs,
    flapping,
    router_restarted,
    decode_killed_mid_transfer,
    prefill_killed_after_handoff,
]

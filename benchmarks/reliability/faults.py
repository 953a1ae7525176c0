"""Faults in front of colocated workers: a worker killed before, during and after a request,
a worker that hangs, health that flaps, the router itself restarted under load.

Each scenario starts its own router and two sim workers, sends real requests, breaks one
process with a signal, and records what the client saw, how long the slowest request took,
the blocks left held on the workers that survived, and whether the pool healed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.reliability.client import Seen, Tally, post, until_answered
from benchmarks.reliability.cluster import Cluster, get_json, metric, settled_leak
from benchmarks.reliability.report import FaultResult
from localrun.processes import Server

BOUND_S = 30.0  # no request may take longer: past it, it hung
HANG_BOUND_S = 10.0  # a hung worker's requests must end well before it wakes (FROZEN_S)
FROZEN_S = 15.0
FLAP_DOWN_S = 4.0  # long enough for 2 failed probes (0.5 s apart, 1 s timeout)
FLAP_UP_S = 3.0
SYSTEM = "You are a careful assistant for a shipping company; cite the policy section. " * 8


@dataclass(frozen=True)
class Settings:
    """How hard a run pushes: the quick preset sends fewer requests and flaps fewer times."""

    requests: int = 8
    flaps: int = 3
    load_threads: int = 3
    quick: bool = False


def chat(n: int, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Parcel {n}?"}]
    return {"messages": messages, "max_tokens": max_tokens, "stream": stream}


def generate(text: str, max_new: int, stream: bool = False) -> dict[str, Any]:
    return {"text": text, "stream": stream, "sampling_params": {"max_new_tokens": max_new}}


def served(router: Server) -> dict[str, int]:
    return {w["url"]: w["processed"] for w in get_json(router.url + "/workers")["workers"]}


def retries(router: Server) -> float:
    """The router's own count of retries (sgl_router_retries_total)."""
    return metric(router, "sgl_router_retries_total")


def holding(
    c: Cluster, first: dict[str, Any], time_scale: float = 0.02
) -> tuple[list[Server], Server, Seen, Server]:
    """Two workers behind a fresh router, the answer to `first`, and the worker that served
    it (its processed count went up): it holds the conversation's prefix now."""
    workers = c.workers(2, time_scale=time_scale)
    router = c.colocated_router(workers)
    before = served(router)
    seen = post(router.url + "/v1/chat/completions", first, BOUND_S)
    after = served(router)
    url = max(after, key=lambda u: after[u] - before.get(u, 0))
    return workers, router, seen, next(w for w in workers if w.url == url)


def tally_into(result: FaultResult, tally: Tally) -> None:
    result.requests += tally.count
    result.answered += tally.ok
    result.clear_errors += tally.clear_errors
    result.unclear += len(tally.unclear)
    result.slowest_s = max(result.slowest_s, tally.slowest_s)
    for bad in tally.unclear[:3]:
        result.notes.append(f"unclear: {bad.summary()}.")


def later_chats(router: Server, n: int = 4) -> Tally:
    """Requests once the fault is over: every one must be answered."""
    return Tally(
        [post(router.url + "/v1/chat/completions", chat(1000 + i), BOUND_S) for i in range(n)]
    )


def healed_after(
    result: FaultResult, ok: bool, how: str, later: Tally, what: str = "later requests"
) -> None:
    """Counts the requests sent once the fault was over into `result`: healed when `ok` and
    every one of them was answered."""
    tally_into(result, later)
    result.healed = ok and later.ok == later.count
    result.healed_how = f"{how}, {later.ok}/{later.count} {what} answered"


def heal(
    c: Cluster,
    router: Server,
    broken: Server,
    result: FaultResult,
    later: Callable[[Server], Tally] = later_chats,
    what: str = "later requests",
) -> Server:
    """The router must see `broken` unhealthy, then restarted healthy again; `later(router)`
    requests after that are answered. Sets `healed` and says how; the restarted server."""
    down = c.wait_health(router, broken.url, healthy=False)
    fresh = c.restart(broken)
    up = c.wait_health(router, fresh.url, healthy=True)
    how = (
        f"marked unhealthy in {down:.1f} s" if down is not None else "never marked unhealthy"
    ) + (f", healthy {up:.1f} s after restart" if up is not None else ", never healthy again")
    healed_after(result, down is not None and up is not None, how, later(router), what)
    return fresh


def finish(result: FaultResult, workers: list[Server]) -> FaultResult:
    leaked = settled_leak(workers)
    result.leaked_blocks = -1 if -1 in leaked.values() else sum(leaked.values())
    if result.leaked_blocks:
        result.notes.append(f"leaked per worker: {leaked}.")
    return result


# ----------------------------------------------------------------------------- scenarios


def killed_before_request(c: Cluster, s: Settings) -> FaultResult:
    """The worker holding a prefix is SIGKILLed; the router has not noticed yet when the
    next turns arrive: it must retry them on the other worker."""
    r = FaultResult(
        "worker killed before the request",
        "SIGKILL to the worker holding the conversation's prefix, just before its next turns",
        bound_s=BOUND_S,
        expected="every turn answered: the router retries on the other worker",
    )
    workers, router, warm, holder = holding(c, chat(1))
    c.kill(holder)
    retried = retries(router)
    tally = Tally()
    for i in range(s.requests):
        tally.add(post(router.url + "/v1/chat/completions", chat(1 if i % 2 else i), BOUND_S))
    tally_into(r, tally)
    r.client_saw = f"{tally.statuses()}; router retries {retries(router) - retried:.0f}"
    r.expectation_met = warm.ok and tally.ok == tally.count
    fresh = heal(c, router, holder, r)
    return finish(r, [*(w for w in workers if w is not holder), fresh])


def kill_busy(c: Cluster, workers: list[Server]) -> Server | None:
    """SIGKILL the worker that is generating now (its /get_load counts a request)."""
    busy = [w for w in workers if get_json(w.url + "/get_load")[0]["num_reqs"] > 0]
    if busy:
        c.kill(busy[0])
    return busy[0] if busy else None


def kill_while(c: Cluster, streamed: bool) -> tuple[Seen, list[Server], Server | None, Server]:
    """A long /generate through a fresh router and two workers; the busy worker killed
    after the 5th event (streamed) or about a second in (non-streamed)."""
    workers = c.workers(2, time_scale=1.0)
    router = c.colocated_router(workers)
    body = generate("Tell me a very long story about parcels.", 3000 if streamed else 800, streamed)
    victim: list[Server | None] = []
    if streamed:

        def on_event(n: int) -> None:
            if n == 5:
                victim.append(kill_busy(c, workers))

        return (
            post(router.url + "/generate", body, BOUND_S, on_event=on_event),
            workers,
            (victim[0] if victim else None),
            router,
        )
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(post, router.url + "/generate", body, BOUND_S)
        deadline = time.monotonic() + 10
        while not (victim and victim[-1]) and time.monotonic() < deadline:
            time.sleep(0.3)
            victim.append(kill_busy(c, workers))
        seen = future.result()
    return seen, workers, victim[-1] if victim else None, router


def killed_mid_request(c: Cluster, s: Settings) -> FaultResult:
    """SIGKILL while the worker is generating: a streamed answer ends with an error event
    and [DONE] (its bytes already reached the client, so it cannot be retried); an answer
    not yet begun (non-streamed) is retried on the other worker."""
    r = FaultResult(
        "worker killed mid-request",
        "SIGKILL to a worker streaming a long answer, and to one generating a non-streamed one",
        bound_s=BOUND_S,
        expected="the stream ends with an error event and [DONE]; the non-streamed request "
        "is retried elsewhere and answered",
    )
    tally = Tally()
    survivors: list[Server] = []
    for streamed in (True, False):
        seen, workers, victim, router = kill_while(c, streamed)
        tally.add(seen)
        r.expectation_met &= (seen.status == 200 and seen.clear_error) if streamed else seen.ok
        if victim is None:
            r.error = "no worker was busy to kill"
            return r
        survivors += [w for w in workers if w is not victim]
        if streamed:
            survivors.append(heal(c, router, victim, r))
    tally_into(r, tally)
    r.client_saw = f"stream: {tally.seen[0].summary()}; non-streamed: {tally.seen[1].summary()}"
    return finish(r, survivors)


def killed_after_answer(c: Cluster, s: Settings) -> FaultResult:
    """A streamed answer completes, then its worker dies: the client has the whole answer;
    the conversation's next turn (the router's tree says the dead worker holds it) is
    retried on the other worker, and the tree forgets the dead one."""
    r = FaultResult(
        "worker killed after streaming",
        "SIGKILL to the worker right after its streamed answer ended",
        bound_s=BOUND_S,
        expected="the stream complete; the next turn retried elsewhere and answered",
    )
    workers, router, first, holder = holding(c, chat(7, stream=True))
    c.kill(holder)
    tally = Tally([first])
    for _ in range(s.requests // 2):
        tally.add(post(router.url + "/v1/chat/completions", chat(7), BOUND_S))
    tally_into(r, tally)
    r.client_saw = (
        f"stream: {first.summary()} with [DONE]={first.done}; next turns {tally.statuses()}"
    )
    r.expectation_met = first.ok and first.done and tally.ok == tally.count
    fresh = heal(c, router, holder, r)
    return finish(r, [*(w for w in workers if w is not holder), fresh])


def hangs(c: Cluster, s: Settings) -> FaultResult:
    """SIGSTOP: the worker's sockets accept and nothing answers. Requests waiting on it
    (before their first byte) must go elsewhere once the router's health checks fail, a
    stream it was sending must end with an error event; SIGCONT heals it."""
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

        body = {**chat(3, max_tokens=2000, stream=True)}
        streamed.append(
            post(router.url + "/v1/chat/completions", body, HANG_BOUND_S, on_event=on_event)
        )

    thread = threading.Thread(target=stream_then_freeze)
    thread.start()
    frozen.wait(BOUND_S)
    tally = Tally()
    with ThreadPoolExecutor(s.requests) as pool:
        futures = [
            pool.submit(post, router.url + "/v1/chat/completions", chat(3), HANG_BOUND_S)
            for _ in range(s.requests)
        ]
        time.sleep(FROZEN_S)
        c.thaw(holder)
        for f in futures:
            tally.add(f.result())
    thread.join()
    stream = streamed[0] if streamed else Seen(error="the stream never ran")
    tally.add(stream)
    tally_into(r, tally)
    r.client_saw = f"new turns {Tally(tally.seen[:-1]).statuses()}; stream: {stream.summary()}"
    r.expectation_met = tally.ok == tally.count - 1 and stream.clear_error
    up = c.wait_health(router, holder.url, healthy=True)
    later = later_chats(router)
    how = f"healthy {up:.1f} s after SIGCONT" if up is not None else "never healthy again"
    healed_after(r, up is not None and all(c.router_view(router).values()), how, later)
    return finish(r, workers)


def flapping(c: Cluster, s: Settings) -> FaultResult:
    """Health that flaps: the worker is stopped and continued every 2.5 s while clients
    keep sending; the router takes it out and puts it back each time."""
    r = FaultResult(
        "health flapping",
        f"SIGSTOP {FLAP_DOWN_S:.0f} s / SIGCONT {FLAP_UP_S:.0f} s, {s.flaps} times, on one "
        "worker under steady load",
        bound_s=BOUND_S,
        expected="every request answered (sent elsewhere or retried) or a clear error",
    )
    workers = c.workers(2)
    router = c.colocated_router(workers)
    victim = workers[0]
    stop = threading.Event()
    transitions: list[tuple[float, bool]] = []

    def watch() -> None:
        last = True
        while not stop.is_set():
            try:
                now = c.router_view(router).get(victim.url, True)
            except (OSError, ValueError):
                now = last
            if now != last:
                transitions.append((time.monotonic(), now))
                last = now
            time.sleep(0.1)

    def load(k: int) -> Tally:
        tally, i = Tally(), 0
        while not stop.is_set():
            i += 1
            tally.add(post(router.url + "/v1/chat/completions", chat(k * 1000 + i), BOUND_S))
            time.sleep(0.05)  # a client's think time
        return tally

    watcher = threading.Thread(target=watch)
    watcher.start()
    with ThreadPoolExecutor(s.load_threads) as pool:
        loads = [pool.submit(load, k) for k in range(s.load_threads)]
        try:
            for _ in range(s.flaps):
                time.sleep(FLAP_UP_S)
                c.freeze(victim)
                time.sleep(FLAP_DOWN_S)
                c.thaw(victim)
            time.sleep(1.0)
        finally:
            stop.set()
        tallies = [f.result() for f in loads]
    watcher.join()
    tally = Tally([seen for t in tallies for seen in t.seen])
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
    """The router SIGKILLed under load and started again on its port: a client in flight
    sees its connection drop or be refused and sends again; workers abort what the dead
    router left running and keep nothing."""
    r = FaultResult(
        "router restarted under load",
        f"SIGKILL to the router with {s.load_threads} clients sending, restarted on its port",
        bound_s=BOUND_S,
        expected="requests cut by the restart fail at the transport; the client's retry "
        "after the restart is answered",
    )
    workers = c.workers(2, time_scale=0.2)
    router = c.colocated_router(workers)
    stop = threading.Event()

    def load(k: int) -> Tally:
        tally, i = Tally(), 0
        while not stop.is_set():
            i += 1
            body = chat(k * 1000 + i, max_tokens=40, stream=bool(i % 2))
            tally.add(until_answered(router.url + "/v1/chat/completions", body, BOUND_S, BOUND_S))
        return tally

    with ThreadPoolExecutor(s.load_threads) as pool:
        loads = [pool.submit(load, k) for k in range(s.load_threads)]
        try:
            time.sleep(2.0)
            c.kill(router)
            time.sleep(0.5)
            router = c.restart(router)
            time.sleep(2.0)
        finally:  # (a restart that fails must not leave the clients sending forever)
            stop.set()
        tallies = [f.result() for f in loads]
    tally = Tally([seen for t in tallies for seen in t.seen])
    tally_into(r, tally)
    retried = [seen for seen in tally.seen if seen.attempts > 1]
    r.client_saw = (
        f"{tally.statuses()}; {len(retried)} requests needed the client to send again, "
        f"{sum(x.ok for x in retried)} of them then answered"
    )
    r.expectation_met = tally.ok == tally.count and bool(retried)
    later = later_chats(router)
    view = c.router_view(router)
    how = f"restarted router sees {sum(view.values())}/{len(view)} workers healthy"
    healed_after(r, all(view.values()), how, later)
    return finish(r, workers)


SCENARIOS: list[Callable[[Cluster, Settings], FaultResult]] = [
    killed_before_request,
    killed_mid_request,
    killed_after_answer,
    hangs,
    flapping,
    router_restarted,
]

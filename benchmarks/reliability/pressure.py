"""Pressure instead of breakage: KV far smaller than the running requests need, a burst
past what the cluster can start in time, a PD decode that must retract KV it received.
Nothing is killed, so nothing may be lost: every answer whole and equal to a roomy worker's
(or refused with 429 and sent again), the pressure counted by the servers, no block held."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

from benchmarks.reliability.client import Seen, Tally, post
from benchmarks.reliability.cluster import Cluster, get_json, metric
from benchmarks.reliability.faults import (
    Scenario,
    Settings,
    finish,
    healed_after,
    ids,
    served,
    tally_into,
)
from benchmarks.reliability.report import BOUND_S, FaultResult
from localrun.processes import Server
from router.policies import CostModel

# A new-token ratio this low admits far more than fits, so running requests must retract.
LOW_RATIO = ["--init-new-token-ratio", "0.05", "--min-new-token-ratio", "0.05"]
# A colocated worker's KV: two requests of 32 + 160 tokens are admitted (their prompts and
# all they may generate fit at admission), and run out of room halfway through decoding.
TIGHT_TOKENS = 256
COLOCATED_SHAPE = (32, 160)  # prompt tokens, max_new_tokens
# The PD decode's device KV: two requests of 120 + 96 tokens are received, one fits.
TIGHT_DECODE_TOKENS = 384
PD_SHAPE = (120, 96)
# A host tier (HiCache): the sim then checks the stamp of every page it reuses.
HOST_TIER = ["--enable-hierarchical-cache", "--hicache-ratio", "4"]
WHOLE = ("length", "stop")  # a finish that is not an abort

# The overloaded cluster: sim workers 20x slower (a 500-token prefill takes 0.4 s), the
# router's cost model slowed to match, a 0.1 s deadline on the expected wait and a queue of
# 4: a burst of 8 goes 2 to the workers, 4 to the queue and 2 back with 429, which find a
# place on the SDK's first retry. Sized by the SDK's two retries, not the preset: refused
# clients come back together (Retry-After ignores the queue), and a burst of 16 ran out.
SLOW = 20.0
DEADLINE_S = 0.1
QUEUE = 4
BURST = 8
COST = CostModel()
ADMISSION = [
    *("--max-expected-wait-secs", str(DEADLINE_S), "--queue-size", str(QUEUE)),
    *("--queue-timeout-secs", "10", "--prefill-secs-per-token"),
    *(str(COST.prefill_s_per_token * SLOW), "--busy-secs-per-request"),
    str(COST.busy_s_per_request * SLOW),
]
BURST_BOUND_S = 15.0  # the whole burst, every SDK retry included


def batch(seed: int, count: int, length: int, max_new: int) -> list[dict[str, Any]]:
    """`count` distinct /generate bodies by token ids (the sim is deterministic on them)."""
    return [
        {"input_ids": ids(seed * 1000 + k, length), "sampling_params": {"max_new_tokens": max_new}}
        for k in range(count)
    ]


def burst(url: str, bodies: list[dict[str, Any]]) -> Tally:
    """Every body at once, each on its own connection and within BOUND_S."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        return Tally(list(pool.map(lambda body: post(url, body, BOUND_S), bodies)))


def finish_type(seen: Seen) -> str | None:
    meta = seen.body.get("meta_info", {}) if isinstance(seen.body, dict) else {}
    return (meta.get("finish_reason") or {}).get("type")


def output_ids(seen: Seen) -> list[int] | None:
    return seen.body.get("output_ids") if isinstance(seen.body, dict) and seen.ok else None


def worker_counts(workers: list[Server]) -> dict[str, float]:
    """Retractions, aborts (even those the router hid by a retry) and pages whose stamps
    the sim checked, summed over `workers`."""
    infos = [get_json(w.url + "/get_server_info") for w in workers]
    states = [info["internal_states"][0] for info in infos]
    return {
        "retracted_reqs": sum(st["num_retracted_reqs"] for st in states),
        "retracted_output_tokens": sum(st["num_retracted_output_tokens"] for st in states),
        "aborted_reqs": sum(metric(w, "sglang:num_aborted_requests_total") for w in workers),
        "verified_pages": sum(info["backend"]["verified_pages"] for info in infos),
    }


def wait_idle(workers: list[Server], timeout: float = 10.0) -> float | None:
    """Seconds until no worker has a request running or queued; None if that never happens."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        states = [get_json(w.url + "/get_server_info")["internal_states"][0] for w in workers]
        if all(st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0 for st in states):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def relieved(
    router: Server, workers: list[Server], result: FaultResult, later: Callable[[], Tally]
) -> Tally:
    """Healed: every worker idle, all healthy to the router, `later()` answered."""
    idle = wait_idle(workers)
    view = Cluster.router_view(router)
    tally = later()
    how = (
        f"workers idle {idle:.1f} s after the burst" if idle is not None else "workers never idle"
    ) + f", router sees {sum(view.values())}/{len(view)} healthy"
    healed_after(result, idle is not None and all(view.values()), how, tally)
    return tally


def retracted_and_intact(
    r: FaultResult,
    router: Server,
    workers: list[Server],
    roomy: Server,
    bodies: list[dict[str, Any]],
    watched: list[Server],
) -> FaultResult:
    """A retraction row: `bodies` at once, each answer whole and equal to `roomy`'s,
    retractions (no abort) counted on `watched`, then relieved and leaks counted."""
    started = time.monotonic()
    tally = burst(router.url + "/generate", bodies)
    took = time.monotonic() - started
    tally_into(r, tally)
    reference = burst(roomy.url + "/generate", bodies)
    whole = sum(finish_type(s) in WHOLE for s in tally)
    equal = sum(
        output_ids(s) is not None and output_ids(s) == output_ids(ref)
        for s, ref in zip(tally, reference, strict=True)
    )
    counts = worker_counts(watched)
    r.measured = {"burst": len(bodies), "whole": whole, "equal_to_roomy": equal, **counts}
    r.measured["burst_s"] = round(took, 2)
    finishes = sorted({str(finish_type(s)) for s in tally})
    r.client_saw = (
        f"{tally.statuses()}, finish {'/'.join(finishes)}; {equal}/{len(tally)} equal to the "
        f"roomy worker's; {counts['retracted_reqs']:.0f} retractions "
        f"({counts['retracted_output_tokens']:.0f} output tokens), "
        f"{counts['aborted_reqs']:.0f} aborts; burst {took:.1f} s"
    )
    r.expectation_met = (
        whole == equal == len(tally) == len(bodies)
        and counts["retracted_reqs"] > 0
        and counts["aborted_reqs"] == 0
        and counts["verified_pages"] > 0
    )

    def later() -> Tally:
        return Tally([post(router.url + "/generate", b, BOUND_S) for b in batch(99, 3, 40, 8)])

    relieved(router, workers, r, later)
    return finish(r, [*workers, roomy])


def squeezed(name: str, n: int, shape: tuple[int, int], where: str, how: str) -> FaultResult:
    """A retraction row: `n` requests of `shape` (prompt, max_new tokens) sent `where`."""
    return FaultResult(
        name,
        f"{n} concurrent requests needing {n * sum(shape)} tokens of KV {where}",
        expected=f"every request answered in full, equal to a roomy worker's answer; {how}",
    )


def tight(tokens: int) -> list[str]:
    """`tokens` of device KV, a new-token ratio admitting more than fits, a host tier."""
    return ["--max-total-tokens", str(tokens), *LOW_RATIO, *HOST_TIER]


def kv_exhausted(c: Cluster, s: Settings) -> FaultResult:
    """Workers whose KV admits two requests but holds one to the end: they retract
    mid-decode and resume from the pages kept, the same tokens, never an abort."""
    n = 2 * s.requests
    where = f"on 2 workers of {TIGHT_TOKENS} tokens each (+ a host tier; new-token ratio 0.05)"
    how = "running requests retracted and resumed, never aborted"
    r = squeezed("KV exhausted mid-decode", n, COLOCATED_SHAPE, where, how)
    workers = c.workers(2, *tight(TIGHT_TOKENS), time_scale=0.25)
    (roomy,) = c.workers(1, time_scale=0)
    router = c.colocated_router(workers)
    bodies = batch(21, n, *COLOCATED_SHAPE)
    return retracted_and_intact(r, router, workers, roomy, bodies, workers)


def retracted_pd_decode(c: Cluster, s: Settings) -> FaultResult:
    """A PD decode with room for one request's KV retracts KV it received by transfer,
    keeps it in its host tier and finishes every request with the same tokens."""
    n = s.requests
    where = (
        f"through a 1P1D pair (caching-3) whose decode holds {TIGHT_DECODE_TOKENS} (+ a host tier)"
    )
    how = "the decode retracts, keeps the KV in its host tier and resumes, never aborts"
    r = squeezed("retracted PD decode", n, PD_SHAPE, where, how)
    decode_flags = tight(TIGHT_DECODE_TOKENS)
    router, prefill, (decode,) = c.pd(1, time_scale=1.0, decode_extra=decode_flags)
    (roomy,) = c.workers(1, time_scale=0)
    bodies = batch(23, n, *PD_SHAPE)
    retracted_and_intact(r, router, [prefill, decode], roomy, bodies, [decode])
    host = get_json(decode.url + "/get_server_info")["kv_tiers"]["host"]
    r.measured.update(
        host_swapped_out_tokens=host["swapped_out_tokens"],
        host_swapped_in_tokens=host["swapped_in_tokens"],
    )
    r.expectation_met &= host["swapped_out_tokens"] > 0 and host["swapped_in_tokens"] > 0
    return r


async def sdk_burst(router: Server, n: int, seed: int) -> list[Seen]:
    """`n` chat completions at once through the OpenAI SDK's defaults (2 retries,
    Retry-After honoured); each one's outcome and tries."""
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="none")
    try:
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(sdk_chat(client, model, seed + i) for i in range(n)))
    finally:
        await client.close()


async def sdk_chat(client: openai.AsyncOpenAI, model: str, i: int) -> Seen:
    """About 500 prompt tokens: 0.4 s of prefill on a worker slowed SLOW times."""
    text = f"question {i}: " + " ".join(f"item{i}x{j}" for j in range(100))
    seen = Seen(attempts=client.max_retries + 1)  # unless the SDK says how many it took
    started = time.monotonic()
    try:
        raw = await asyncio.wait_for(
            client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=1
            ),
            BOUND_S,
        )
        completion = raw.parse()
        seen.status, seen.attempts = raw.status_code, raw.retries_taken + 1
        seen.body = {"finish_reason": completion.choices[0].finish_reason}
    except TimeoutError:
        seen.hung = True
    except openai.APIStatusError as exc:
        seen.status, seen.body = exc.status_code, {"message": exc.message}
    except openai.APIConnectionError as exc:
        seen.error = f"{type(exc).__name__}: {exc}"
    seen.seconds = time.monotonic() - started
    return seen


def overloaded(c: Cluster, s: Settings) -> FaultResult:
    """A burst past the router's deadline on the expected wait: it queues what fits and
    refuses the rest with 429; OpenAI SDK clients with default retries all succeed."""
    n = BURST  # set by the cluster's capacity and the SDK's retries, not by the preset
    r = FaultResult(
        "overloaded cluster",
        f"a burst of {n} chat requests (OpenAI SDK, default retries) on 2 sim workers slowed "
        f"{SLOW:g}x, router --max-expected-wait-secs {DEADLINE_S:g} --queue-size {QUEUE}",
        expected="some requests refused with 429 + Retry-After, every one answered through "
        f"the SDK's retries, the burst over within {BURST_BOUND_S:.0f} s",
    )
    workers = c.workers(2, time_scale=SLOW)
    router = c.colocated_router(workers, *ADMISSION)
    started = time.monotonic()
    tally = Tally(asyncio.run(sdk_burst(router, n, 0)))
    took = time.monotonic() - started
    tally_into(r, tally)
    reached = sum(served(router).values())  # a refused request never reached a worker
    refusals = metric(router, "memserve_router_admission_refusals_total")
    retried = sum(seen.attempts - 1 for seen in tally)
    r.measured = {
        "burst": n,
        "refusals_429": refusals,
        "holds": metric(router, "memserve_router_admission_holds_total"),
        "sdk_retries": retried,
        "burst_s": round(took, 2),
    }
    r.client_saw = (
        f"{tally.statuses()}; the router refused {refusals:.0f} times, the SDK retried "
        f"{retried} times; workers served {reached}; burst {took:.1f} s"
    )
    # every retry the SDK made was for a 429 from the router (no transport error, no 5xx)
    r.expectation_met = (
        tally.ok == len(tally) == reached
        and refusals > 0
        and retried == refusals
        and took <= BURST_BOUND_S
    )

    def later() -> Tally:
        return Tally(asyncio.run(sdk_burst(router, 2, 1000)))

    after = relieved(router, workers, r, later)
    queued = metric(router, "memserve_router_admission_queued")
    at_once = sum(seen.attempts == 1 for seen in after)
    r.healed &= queued == 0 and at_once == len(after)
    r.healed_how += f" ({at_once} without a 429), {queued:.0f} left in the router's queue"
    return finish(r, workers)


SCENARIOS: list[Scenario] = [
    kv_exhausted,
    overloaded,
    retracted_pd_decode,
]

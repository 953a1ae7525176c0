"""Replay a run's requests through the router's policies on a perfect view of the cluster.

A hot-prefix run takes minutes and mixes the policy with everything around it: the engines'
own speed, PD's KV transfers, load figures that lag the engines. This replays the same
requests (rebuilt from the run's seed, sent at their planned times: the preset is open-loop)
through the router's own policy objects, in seconds, against a model of the cluster: one
first-come-first-served queue per prefill worker serving each request in its floor time
(`floor.py`, times `speed`), and per worker an LRU page cache of the run's device KV,
evicting as `oracle.LruCaches` does, that the policy sees exactly (KV events with no delay;
load counted from the queues). Requests are bound to a worker when they arrive, as a router
binds them.

What a policy gets here is what it gets from a perfect view of the cluster; what the run
measured beyond it was lost outside the policy, to the engines or to what the router saw.
Beside the policies it replays `earliest`: each request to the worker where its prefill would
end soonest (that worker's queue and its cached prefix, known exactly), a greedy reference.
PD clusters are replayed on their prefills, each request's TTFT then counting the least PD
adds to it: its whole prompt's KV moved to a decode (PD-Caching-1: the decode caches none of
it) and the decode's first step, alone.

`python -m benchmarks.multiturn.policy_replay DIR` replays DIR/results.json's hot-prefix runs
and writes DIR/policy_replay.json and .md.
"""

from __future__ import annotations

import argparse
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from benchmarks.harness import percentile, progress_bar, shown_command, step
from benchmarks.multiturn.floor import Floor
from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.oracle import PAGE, held_pages, lru_insert, page_keys
from benchmarks.multiturn.queue_floor import prefill_servers
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import Request
from benchmarks.report.page import machine_facts, write_results
from benchmarks.report.seeds import spread, spread_text
from benchmarks.report.table import markdown_table
from connector.worker.latency_model import LatencyModel
from mempool._radix import Heat
from router.policies import (
    CostModel,
    Policy,
    PromptTree,
    RouteRequest,
    Thresholds,
    make_policy,
    policy_name,
    reusable,
)
from router.trees import PrefixView, PromptTrees
from router.workers import Worker, WorkerType

EARLIEST = "earliest"
DEFAULT_POLICIES = ("round_robin", "cache_aware", "prompt_tree", "cost", EARLIEST)
# the run's systems that run these policies on its PD-Caching-1 or colocated cluster
MEASURED = {
    "ours prompt_tree": "prompt_tree",
    "ours cost": "cost",
    "sglang-router cache_aware": "cache_aware",
    "sglang-router round_robin": "round_robin",
    "sglang-router PD cache_aware/power_of_two": "cache_aware",
    "sglang-router PD round_robin/round_robin": "round_robin",
}


@dataclass(slots=True)
class Job:
    start_s: float
    end_s: float
    computed: int  # prompt tokens it computes


@dataclass
class ReplayWorker:
    """One prefill worker: its FIFO queue and its LRU page cache."""

    capacity_pages: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    ever: set[int] = field(default_factory=set)  # pages it ever held: where prefixes lived
    free_at: float = 0.0
    jobs: list[Job] = field(default_factory=list)

    def reused(self, keys: Sequence[int], n: int) -> int:
        """Tokens of an `n`-token prompt of page `keys` its cache serves (whole pages, the
        last token computed)."""
        return reusable(held_pages(self.cache, keys) * PAGE, n, PAGE)

    def serve(self, keys: Sequence[int], now: float, seconds: float) -> float:
        """Queue a request arriving `now` that takes `seconds`; cache its pages; its TTFT."""
        start = max(now, self.free_at)
        self.free_at = start + seconds
        lru_insert(self.cache, keys, self.capacity_pages)
        self.ever.update(keys)
        return self.free_at - now


class ExactTrees:
    """The prompt trees a router would hold with instant KV events: what each worker's
    cache holds of the prompt now (`held`), and where its pages lived before (`home`)."""

    page_size = PAGE

    def __init__(self, workers: dict[str, ReplayWorker]) -> None:
        self.workers = workers
        self.keys: list[int] = []  # the prompt being routed

    def match(self, type: WorkerType, tokens: Sequence[int]) -> PrefixView:
        keys, workers = self.keys, self.workers.items()
        held = {u: n * PAGE for u, w in workers if (n := held_pages(w.cache, keys))}
        home = {u: n * PAGE for u, w in workers if (n := held_pages(w.ever, keys))}
        return PrefixView(held, dict(held), home)


@dataclass(frozen=True)
class ReplayResult:
    mean_s: float
    p50_s: float
    p99_s: float
    hit: float


class Replay:
    """One cluster model and one policy; `run(requests)` replays them in send order."""

    def __init__(
        self,
        policy: str,
        servers: int,
        capacity_tokens: int,
        service: Callable[[int, int], float],
        after: Callable[[int], float] = lambda n: 0.0,
    ) -> None:
        """`service(n, cached)`: a prompt's seconds on its worker; `after(n)`: seconds its
        first token takes once its prefill ends, the worker free (PD's KV hand-off)."""
        if servers < 1 or capacity_tokens < PAGE:
            raise ValueError(
                f"a replay needs a worker and a page of KV, got {servers} of {capacity_tokens}"
            )
        self.urls = [f"worker-{i}" for i in range(servers)]
        self.state = {u: ReplayWorker(capacity_tokens // PAGE) for u in self.urls}
        self.handles = [Worker(u, type=WorkerType.PREFILL) for u in self.urls]
        self.trees = ExactTrees(self.state)
        self.service, self.after = service, after
        self.now = 0.0
        self.policy: Policy | None = None
        if policy != EARLIEST:
            trees = cast(PromptTrees, self.trees)  # the part of PromptTrees policies read
            self.policy = make_policy(policy, trees, Thresholds(), CostModel(), pulls=False)
            if isinstance(self.policy, PromptTree):  # heat decays on the replay's clock
                self.policy.heat = Heat(PAGE, clock=lambda: self.now)

    def run(self, requests: Sequence[Request]) -> ReplayResult:
        """The requests in send order; the policies' random tie-breaks are seeded (and the
        module's random state restored after), so a replay is the same every time."""
        outside = random.getstate()
        random.seed("policy-replay")
        try:
            return self._run(requests)
        finally:
            random.setstate(outside)

    def _run(self, requests: Sequence[Request]) -> ReplayResult:
        ttft: list[float] = []
        prompt = reused = 0
        for request in sorted(requests, key=lambda r: (r.at_s, r.rid)):
            ids = list(request.prompt_ids or [])
            if not ids:
                raise ValueError(f"request {request.rid} has no prompt ids to replay")
            self.now = request.at_s
            keys = page_keys(ids)
            self.trees.keys = keys
            url = self._choose(request, ids, keys)
            worker = self.state[url]
            cached = worker.reused(keys, len(ids))
            seconds = self.service(len(ids), cached)
            wait = worker.serve(keys, self.now, seconds)
            worker.jobs.append(Job(worker.free_at - seconds, worker.free_at, len(ids) - cached))
            if not request.warmup:
                ttft.append(wait + self.after(len(ids)))
                prompt, reused = prompt + len(ids), reused + cached
        if not ttft:
            raise ValueError("no measured request to replay")
        return ReplayResult(
            sum(ttft) / len(ttft), percentile(ttft, 0.5), percentile(ttft, 0.99), reused / prompt
        )

    def _choose(self, request: Request, ids: list[int], keys: list[int]) -> str:
        if self.policy is None:
            return min(self.urls, key=lambda u: self._earliest_end(u, len(ids), keys))
        for handle in self.handles:  # the load a router counts: sent and not yet answered
            worker = self.state[handle.url]
            worker.jobs = [j for j in worker.jobs if j.end_s > self.now]
            handle.in_flight = len(worker.jobs)
            handle.in_flight_tokens = sum(j.computed for j in worker.jobs)
            handle.unstarted = sum(j.start_s > self.now for j in worker.jobs)
        route = RouteRequest(array("I", ids), request.prompt or "", None, WorkerType.PREFILL)
        return self.policy.select(route, self.handles).worker.url

    def _earliest_end(self, url: str, n: int, keys: list[int]) -> float:
        worker = self.state[url]
        return max(self.now, worker.free_at) + self.service(n, worker.reused(keys, n))


def replay_run(
    run: dict[str, Any], requests: Sequence[Request], policy: str, speed: float
) -> ReplayResult:
    """`requests` (the run's workload) through `policy` on the run's cluster, its engines
    `speed` times slower than the floor."""
    model = run["floor_model"]
    latency, scale = LatencyModel(), model["time_scale"]
    floor = Floor(latency, int(model["chunked_prefill_size"]), scale)
    capacity = run.get("worker_capacity_tokens") or run.get("instance_kv_tokens")
    servers = prefill_servers(run["worker_roles"])

    def service(n: int, cached: int) -> float:
        return floor.ttft_s(n, cached) * speed

    def hand_off(n: int) -> float:
        pages = -(-n // PAGE)
        return (latency.transfer_s(pages, PAGE) + latency.decode_s(1, n)) * scale * speed

    pd = "prefill" in run["worker_roles"]
    replay = Replay(policy, servers, int(capacity or 0), service, hand_off if pd else lambda n: 0.0)
    return replay.run(requests)


def replayable(run: dict[str, Any]) -> bool:
    """An open-loop hot-prefix run without a host tier on the modelled cluster."""
    return (
        run.get("workload") == "hot_prefix"
        and not run.get("hicache_ratio")
        and bool(run.get("worker_capacity_tokens") or run.get("instance_kv_tokens"))
        and run.get("pd_caching") in (None, "caching-1")
    )


def replay_results(
    runs: Sequence[dict[str, Any]],
    vocab: Vocab,
    policies: Sequence[str],
    speeds: Sequence[float],
) -> list[dict[str, Any]]:
    """One row per (cluster shape, seed, speed, policy), with the run's measured figures
    for the systems that ran that policy there."""
    cases: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:
        if replayable(run):
            cases.setdefault((run["shape"], run["seed"]), run)
    rows: list[dict[str, Any]] = []
    progress = progress_bar()
    with progress:
        task = progress.add_task("policy replay", total=len(cases) * len(speeds) * len(policies))
        for (shape, seed), run in sorted(cases.items()):
            requests = HotPrefix.from_params(run["workload_params"]).build(vocab).requests
            measured = measured_figures(runs, shape, seed)
            for speed in speeds:
                for policy in policies:
                    result = replay_run(run, requests, policy, speed)
                    rows.append(
                        {
                            "shape": shape,
                            "seed": seed,
                            "speed": speed,
                            "policy": policy,
                            "ttft_mean_s": result.mean_s,
                            "ttft_p50_s": result.p50_s,
                            "ttft_p99_s": result.p99_s,
                            "hit_ratio": result.hit,
                            "measured": measured.get(policy),
                        }
                    )
                    step(progress, task)
    return rows


def measured_figures(runs: Sequence[dict[str, Any]], shape: str, seed: int) -> dict[str, Any]:
    """The run's TTFT mean, p99 and hit ratio (pulled prefixes included) per policy, for
    its systems that ran it."""
    out: dict[str, Any] = {}
    for run in runs:
        policy = MEASURED.get(run["system"])
        if policy is None or run["shape"] != shape or run["seed"] != seed:
            continue
        if run.get("pd_caching") not in (None, "caching-1") or run.get("ttft_p99_s") is None:
            continue
        out[policy] = {k: run[k] for k in ("ttft_mean_s", "ttft_p99_s")}
        # reused as the replay counts it: from the device, or pulled from a peer's cache
        out[policy]["hit_ratio"] = run["hit_ratio"] + (run.get("pulled_share") or 0.0)
    return out


def summary_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (shape, speed, policy): medians [min..max] over the seeds, replayed and measured."""
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["shape"], row["speed"], row["policy"]), []).append(row)
    out = []
    for (shape, speed, policy), group in groups.items():
        measured = [r["measured"] for r in group if r["measured"]]
        out.append(
            {
                "shape": shape,
                "engines": f"{speed:g}x the floor",
                "policy": policy,
                "seeds": len(group),
                "TTFT mean s": _spread([r["ttft_mean_s"] for r in group]),
                "p99 s": _spread([r["ttft_p99_s"] for r in group]),
                "hit": _spread([r["hit_ratio"] for r in group], percent=True),
                "measured mean s": _spread([m["ttft_mean_s"] for m in measured]),
                "measured p99 s": _spread([m["ttft_p99_s"] for m in measured]),
                "measured hit": _spread([m["hit_ratio"] for m in measured], percent=True),
            }
        )
    return out


def _spread(values: Sequence[float], percent: bool = False) -> str:
    scaled = [v * 100 for v in values] if percent else values
    return spread_text(spread(scaled), 0 if percent else 2, unit="%" if percent else "") or "—"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a results directory of a hot-prefix run")
    parser.add_argument(
        "--policies",
        nargs="+",
        default=list(DEFAULT_POLICIES),
        help=f"router policies to replay, and {EARLIEST!r} (default: %(default)s)",
    )
    parser.add_argument(
        "--speeds",
        nargs="+",
        type=float,
        default=[1.0, 1.1],
        help="engines this many times slower than the floor (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    import json
    import sys

    from connector.model_files import ensure_hf_model
    from shared.tokenizer import ChatTokenizer

    policies = [p if p == EARLIEST else _policy(parser, p) for p in args.policies]
    if any(s <= 0 for s in args.speeds):
        parser.error("--speeds must be positive")
    path = args.out / "results.json"
    if not path.is_file():
        parser.error(f"{path} does not exist")
    data = json.loads(path.read_text())
    if not any(replayable(run) for run in data.get("runs") or []):
        parser.error(f"{path} has no hot-prefix run to replay (open-loop, device KV only)")
    vocab = Vocab.from_tokenizer(ChatTokenizer(ensure_hf_model()))
    rows = replay_results(data["runs"], vocab, policies, args.speeds)
    summary = summary_rows(rows)
    notes = [part.replace("\n", " ") for part in __doc__.split("\n\n")[1:3]]
    command = shown_command("python -m benchmarks.multiturn.policy_replay", sys.argv[1:])
    source = data.get("command")
    figures = {"command": command, "source": source, "rows": rows, "summary": summary}
    lead = [f"`{command}`, replaying the runs of `{source}`.", ""]
    write_results(
        args.out,
        "policy_replay",
        figures,
        None,
        "Policy replay: the run's requests through each policy on a perfect view of the cluster",
        notes,
        machine=machine_facts(),
        body=[*lead, markdown_table(summary), ""],
    )
    print(f"{args.out}/policy_replay.md: {len(rows)} replays")


def _policy(parser: argparse.ArgumentParser, name: str) -> str:
    try:
        return policy_name(name)
    except ValueError as exc:
        parser.error(str(exc))
        raise


if __name__ == "__main__":
    main()

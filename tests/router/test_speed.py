"""Each worker's speed, learned from measured times to first token: a slow engine is priced
as slow, and traffic goes where the first token comes soonest."""

from __future__ import annotations

import json
import math
import random
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from router.policies import CostModel, Decision
from router.speed import EngineSpeed, Work
from router.workers import Agent, BreakerConfig, Worker, WorkerRegistry
from tests.http_client import call
from tests.procs import running


def _traffic(
    speed: EngineSpeed,
    true: tuple[float, float, float, float],
    n: int = 300,
    cold_share: float = 0.3,
    noise: float = 0.2,
    seed: int = 0,
) -> None:
    """`n` requests, a share of them cold ~4K-token prompts and the rest short suffixes of
    cached prefixes, measured as an engine with `true` (overhead s, queue, per-token and
    per-pair multipliers) would take, with multiplicative noise."""
    rng = random.Random(seed)
    for _ in range(n):
        new = rng.randint(3000, 5000) if rng.random() < cold_share else rng.randint(20, 200)
        work = Work(rng.random() * 0.05, new * 4e-5, new * new / 2 * 1.3e-9)
        overhead, queue, token, pair = true
        measured = overhead + queue * work.queue_s + token * work.tokens_s + pair * work.pairs_s
        speed.observe(measured * rng.lognormvariate(0, noise), work)


def test_each_term_is_learned_with_the_overhead_apart() -> None:
    for true in ((0.005, 1.0, 1.0, 1.0), (0.005, 4.0, 4.0, 4.0), (0.05, 10.0, 10.0, 10.0)):
        speed = EngineSpeed()
        _traffic(speed, true)
        assert speed.samples == 300
        assert math.isclose(speed.token_x, true[2], rel_tol=0.15), speed.as_json()
        assert math.isclose(speed.queue_x, true[1], rel_tol=0.15), speed.as_json()
        assert 0.2 * true[0] < speed.overhead_s < 2 * true[0], speed.as_json()


def test_a_hot_prefix_holder_is_not_mistaken_for_a_slow_engine() -> None:
    """Mostly short suffixes on a cached prefix and 6 ms of overhead: the ratio of measured
    to modelled time is ~2.5 per request, but the engine prefills at the constants' speed."""
    speed = EngineSpeed()
    _traffic(speed, (0.006, 1.0, 1.0, 1.0), cold_share=0.05)
    assert 0.8 < speed.slowness < 1.25, speed.as_json()
    assert 0.003 < speed.overhead_s < 0.009, speed.as_json()


def test_a_few_requests_slowed_by_their_batch_do_not_make_an_engine_look_slow() -> None:
    """One short suffix in ten waits 3-12x its own work behind a prefill the engine batched
    ahead of it (an engine steps whole batches): a least-squares fit let those few samples
    price an engine at the constants' speed 2.5-4x slow, and the cost rule starved it (the
    sweep's 10-prefix cell, issue 37)."""
    for seed in range(5):
        speed, rng = EngineSpeed(), random.Random(seed)
        for _ in range(300):
            new = rng.randint(3000, 5000) if rng.random() < 0.1 else rng.randint(20, 400)
            work = Work(rng.random() * 0.02, new * 4e-5, new * new / 2 * 1.3e-9)
            measured = 0.02 + work.total_s
            if rng.random() < 0.1:
                measured *= rng.uniform(3, 12)
            speed.observe(measured * rng.lognormvariate(0, 0.1), work)
        assert 0.75 < speed.slowness < 1.35, (seed, speed.as_json())
        assert 0.6 < speed.queue_x < 1.6, (seed, speed.as_json())


def test_the_fit_follows_an_engine_that_changes_speed() -> None:
    speed = EngineSpeed()
    _traffic(speed, (0.005, 4.0, 4.0, 4.0))
    assert speed.slowness > 3
    _traffic(speed, (0.005, 1.0, 1.0, 1.0), seed=1)  # the engine got faster
    assert speed.slowness < 1.2, speed.as_json()


def test_a_worker_no_answer_measures_fades_back_to_the_constants_and_relearns() -> None:
    """A worker fitted slow gets little traffic, so nothing would correct a fit made while it
    was briefly held up: with no sample for 30 s its evidence fades (halving every 30 s),
    and within about 5 minutes the constants' prior outweighs it."""
    speed = EngineSpeed()
    _traffic(speed, (0.005, 4.0, 4.0, 4.0))
    last = speed._last_sample
    speed.fade(last + 20)  # measured lately: kept
    assert speed.slowness > 3.5, speed.as_json()
    speed.fade(last + 30 + 30)  # half the evidence: still plenty
    assert speed.slowness > 3.5, speed.as_json()
    for seconds in range(90, 361, 30):  # as the load loop calls it, in steps
        speed.fade(last + seconds)
    assert speed.slowness < 1.3 and speed.queue_x < 1.3, speed.as_json()
    _traffic(speed, (0.005, 4.0, 4.0, 4.0), n=12, seed=5)  # probed again: still 4x slow
    assert speed.slowness > 3, speed.as_json()


def test_evidence_faded_out_is_dropped_and_fading_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty half-lives on, what is left of a fit is dropped: the worker reads as never
    measured (no samples, the constants) and the load loop stops refitting it each second;
    its next answer starts a fit afresh."""
    speed = EngineSpeed()
    _traffic(speed, (0.005, 4.0, 4.0, 4.0))
    last = speed._last_sample
    speed.fade(last + 30 + 19 * 30)
    assert speed.samples > 0  # 2^-19 of it left: still a fit
    speed.fade(last + 30 + 21 * 30)
    assert speed.samples == 0, speed.as_json()
    assert speed.slowness == pytest.approx(1.0) and speed.queue_x == pytest.approx(1.0)
    assert speed.overhead_s == pytest.approx(0.0, abs=1e-9)
    refits: list[EngineSpeed] = []
    with monkeypatch.context() as patch:
        patch.setattr(EngineSpeed, "_fit", refits.append)
        speed.fade(last + 3600)
    assert not refits
    _traffic(speed, (0.005, 4.0, 4.0, 4.0), n=12, seed=5)
    assert speed.samples == 12 and speed.slowness > 3, speed.as_json()


def test_the_registry_fades_the_speeds_of_workers_no_answer_measured() -> None:
    registry = WorkerRegistry(BreakerConfig())
    measured, idle = registry.add("http://127.0.0.1:1"), registry.add("http://127.0.0.1:2")
    now = time.monotonic()
    for worker, at in ((measured, now), (idle, now - 600)):
        for _ in range(30):
            worker.speed.observe(0.4, Work(0.0, 0.1, 0.0), now=at)
    assert measured.speed.slowness > 3 and idle.speed.slowness > 3
    registry.fade_speeds()
    assert measured.speed.slowness > 3, measured.speed.as_json()
    assert idle.speed.slowness < 1.3, idle.speed.as_json()


def test_a_stall_is_clamped_and_fixed_speeds_do_not_learn() -> None:
    speed = EngineSpeed()
    work = Work(0.0, 0.1, 0.0)
    speed.observe(0.0, work)  # no time measured: not a sample
    assert speed.samples == 0 and speed.slowness == 1.0
    speed.observe(1e6, work)  # a stalled stream counts as 20x its prediction at most
    assert speed.samples == 1 and speed.expected_s(work) < 20 * 0.1
    fixed = EngineSpeed(learn=False)
    fixed.observe(1.0, work)
    assert fixed.slowness == 1.0 and fixed.samples == 0


def test_what_is_not_learned_is_taken_out_of_the_measurement() -> None:
    """Host-tier loads (and adapter loads) are modelled, not learned: a request that spent
    most of its time loading does not make the engine look slow."""
    speed = EngineSpeed()
    for _ in range(100):
        work = Work(0.0, 0.01, 0.0, fixed_s=0.2)
        speed.observe(0.2 + 0.01, work)
    assert 0.7 < speed.slowness < 1.3, speed.as_json()


def test_a_pull_transfer_is_learned_apart_from_the_prefill() -> None:
    """A link 2.5x slower than the constant, under an engine at the constants' speed: the
    pulls' time is put on the transfer, not on the prefill."""
    speed, rng = EngineSpeed(), random.Random(3)
    for _ in range(300):
        new = rng.randint(20, 3000)
        moved = rng.randint(1000, 8000) * 5.2e-6 if rng.random() < 0.4 else 0.0
        work = Work(rng.random() * 0.02, new * 4e-5, new * new / 2 * 1.3e-9, moved)
        true = 0.01 + work.queue_s + work.tokens_s + work.pairs_s + 2.5 * moved
        speed.observe(true * rng.lognormvariate(0, 0.1), work)
    assert math.isclose(speed.transfer_x, 2.5, rel_tol=0.2), speed.as_json()
    assert 0.8 < speed.slowness < 1.25, speed.as_json()
    cost, worker, source = CostModel(), Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")
    worker.agent, source.agent = Agent(1, "127.0.0.1", 7101), Agent(2, "127.0.0.1", 7102)
    plain = cost.plan(worker, 8192, 0, source=source, best=8000)
    worker.speed.transfer_x = 40.0  # a pull over this link takes longer than the prefill
    assert plain.pull and not cost.plan(worker, 8192, 0, source=source, best=8000).pull


def test_an_answer_is_priced_as_the_engine_reports_it_went() -> None:
    """A request planned to pull 4,096 tokens whose holder had lost them is recomputed whole:
    learned against the plan, an engine at the constants' speed reads as twice as slow, with
    tens of ms of overhead (the cost rule plans such pulls often, and equal workers were
    fitted at 0.4-7x and starved); against what the engine reported, at the constants."""
    cost = CostModel()
    worker, holder = Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")
    worker.agent, holder.agent = Agent(1, "127.0.0.1", 7101), Agent(2, "127.0.0.1", 7102)
    plan = cost.plan(worker, 4200, 0, source=holder, best=4096)
    assert plan.pull and plan.work is not None
    decision = Decision(worker, 0, [(holder, 4096)], "pull", holder, plan.work)
    assert decision.planned_pull == 4096
    pulled = cost.served_work(decision, 4200, 0, 4096)
    assert math.isclose(pulled.moved_s, plan.work.moved_s) and pulled.tokens_s == plan.work.tokens_s
    lost = cost.served_work(decision, 4200, 0, 0)
    assert lost.moved_s == 0 and math.isclose(lost.tokens_s, 4200 * cost.prefill_s_per_token)
    assert lost.queue_s == plan.work.queue_s
    by_plan, by_answer = EngineSpeed(), EngineSpeed()
    recomputed = 0.005 + lost.tokens_s + lost.pairs_s  # what the engine took
    for _ in range(50):
        by_plan.observe(recomputed, plan.work)
        by_answer.observe(recomputed, lost)
    assert by_plan.slowness > 2 and by_plan.overhead_s > 0.02, by_plan.as_json()
    assert 0.8 < by_answer.slowness < 1.25, by_answer.as_json()
    assert by_answer.overhead_s < 0.01, by_answer.as_json()


def test_the_cost_model_prices_a_slow_worker_by_its_coefficients() -> None:
    cost = CostModel()
    fast, slow = Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")
    slow.speed.queue_x = slow.speed.token_x = slow.speed.pair_x = 4.0
    for w in (fast, slow):
        w.in_flight, w.in_flight_tokens = 2, 3000
    a, b = cost.plan(fast, 2000, 0), cost.plan(slow, 2000, 0)
    assert math.isclose(b.seconds, 4 * a.seconds)
    assert a.work == b.work and a.work is not None
    assert math.isclose(a.work.total_s, a.seconds)
    assert math.isclose(cost.queue_s(slow), 4 * cost.queue_s(fast))
    slow.speed.overhead_s = 0.05  # every request pays it, whatever its size
    assert math.isclose(cost.plan(slow, 2000, 0).seconds, 4 * a.seconds + 0.05)


def _workers(router: str) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(router + "/workers", timeout=10) as resp:
        return {w["url"]: w for w in json.loads(resp.read())["workers"]}


def _stream(router: str, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    req = urllib.request.Request(
        router + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def test_a_worker_four_times_slower_is_learned_and_avoided(tmp_path: Path) -> None:
    """Two sim workers, one at a quarter of the other's speed (--time-scale 4): after a few
    streamed requests the router's slowness for it is about 4x the other's, and new prompts
    (nothing cached anywhere) go mostly to the fast one."""
    sim = ["--backend", "sim", "--page-size", "16"]
    with (
        running("connector.worker", [*sim, "--instance-id", "1"], tmp_path) as fast,
        running(
            "connector.worker", [*sim, "--instance-id", "2", "--time-scale", "4"], tmp_path
        ) as slow,
        running(
            "router",
            ["--policy", "prompt_tree", "--worker-urls", fast.url, slow.url],
            tmp_path,
        ) as router,
    ):
        for i in range(24):  # 24 distinct ~3K-token prompts, one at a time
            _stream(router.url, f"{i} " + " ".join(f"w{i * 7 + j}" for j in range(1500)))
        workers = _workers(router.url)
        learned = {u: w["speed"] for u, w in workers.items()}
        ratio = workers[slow.url]["slowness"] / workers[fast.url]["slowness"]
        # (the fast worker's own CPU work counts in its time: on a busy machine it reads slower)
        assert 2.0 < ratio < 6.5, learned
        # the same figures for Prometheus: each coefficient per worker, and the overhead
        _, page = call(router.url + "/metrics")
        gauges = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("memserve_router_worker_")
        }
        per_token = f'memserve_router_worker_speed{{term="per_token",worker="{slow.url}"}}'
        assert math.isclose(
            gauges[per_token], workers[slow.url]["speed"]["per_token"], rel_tol=1e-3
        )
        assert f'memserve_router_worker_overhead_seconds{{worker="{fast.url}"}}' in gauges
        before = {u: int(w["processed"]) for u, w in workers.items()}
        for i in range(24, 40):
            _stream(router.url, f"{i} " + " ".join(f"w{i * 7 + j}" for j in range(1500)))
        after = {u: int(w["processed"]) for u, w in _workers(router.url).items()}
        to_fast = after[fast.url] - before[fast.url]
        assert to_fast >= 14, (before, after)  # of 16: the idle fast worker is sooner
        status, _ = call(router.url + "/health")
        assert status == 200

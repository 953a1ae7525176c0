"""Each worker's speed, learned from measured times to first token: a slow engine is priced
as slow, and traffic goes where the first token comes soonest."""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

from router.policies import CostModel
from router.speed import ALPHA, EngineSpeed
from router.workers import Worker
from tests.http_client import call
from tests.procs import running


def test_slowness_follows_the_ratio_of_measured_to_modelled() -> None:
    speed = EngineSpeed()
    for _ in range(5):
        speed.observe(0.4, 0.1)
    assert math.isclose(speed.slowness, 4.0, rel_tol=1e-9)  # the mean of the first samples
    for _ in range(200):  # the engine got faster: the average follows, a sample at a time
        speed.observe(0.1, 0.1)
    assert speed.slowness < 1.05
    speed.observe(0.1, 0.1 * 0.999)
    assert speed.samples == 206


def test_noise_is_ignored_and_outliers_are_clamped() -> None:
    speed = EngineSpeed()
    speed.observe(5.0, 0.0005)  # under 2 ms of modelled work: not a sample
    speed.observe(0.0, 0.1)  # no time measured: not a sample
    assert speed.samples == 0 and speed.slowness == 1.0
    speed.observe(1e6, 0.1)
    assert math.isclose(speed.slowness, 50.0)
    fixed = EngineSpeed(learn=False)
    fixed.observe(1.0, 0.1)
    assert fixed.slowness == 1.0 and fixed.samples == 0
    assert ALPHA < 0.5


def test_the_cost_model_prices_a_slow_worker_by_its_slowness() -> None:
    cost = CostModel()
    fast, slow = Worker("http://127.0.0.1:1"), Worker("http://127.0.0.1:2")
    slow.speed.slowness = 4.0
    for w in (fast, slow):
        w.in_flight, w.in_flight_tokens = 2, 3000
    a, b = cost.plan(fast, 2000, 0), cost.plan(slow, 2000, 0)
    assert math.isclose(b.seconds, 4 * a.seconds)
    assert math.isclose(a.work_s, b.work_s) and math.isclose(a.work_s, a.seconds)
    assert math.isclose(cost.queue_s(slow), 4 * cost.queue_s(fast))


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
        learned = {u: (w["slowness"], w["slowness_samples"]) for u, w in workers.items()}
        ratio = workers[slow.url]["slowness"] / workers[fast.url]["slowness"]
        assert 2.5 < ratio < 6.5, learned
        before = {u: int(w["processed"]) for u, w in workers.items()}
        for i in range(24, 40):
            _stream(router.url, f"{i} " + " ".join(f"w{i * 7 + j}" for j in range(1500)))
        after = {u: int(w["processed"]) for u, w in _workers(router.url).items()}
        to_fast = after[fast.url] - before[fast.url]
        assert to_fast >= 14, (before, after)  # of 16: the idle fast worker is sooner
        status, _ = call(router.url + "/health")
        assert status == 200

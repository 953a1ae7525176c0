"""The LoRA benchmark (`--lora`, issue 38): its quick preset end to end (files and fields,
not the ratios), and its parts on their own: the workload (adapters of Zipf popularity,
prefixes per adapter), the request bodies that name an adapter, the workers' flags and
their adapter counters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.load.bodies import COMPLETIONS, GENERATE, body
from benchmarks.multiturn import lora_preset
from benchmarks.multiturn.lora import LoraPrefix, adapter_name
from localrun import adapters
from localrun.cluster import Cluster, ClusterSpec, lora_counters
from tests.benchmarks.runs import benchmark, finite
from tests.benchmarks.test_multiturn_paired import Words, check_paired_run, check_report
from tests.http_client import call


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    done = benchmark("multiturn", out, "--lora", "--quick", timeout=300)
    assert done.returncode == 0, f"benchmark failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return out


def test_lora_quick(lora_dir: Path) -> None:
    figures = json.loads((lora_dir / "results.json").read_text())
    assert figures["preset"] == "lora-quick"
    assert "--lora --quick" in figures["command"]
    runs = check_paired_run(figures)
    systems = {"ours prompt_tree", "ours lora_affinity", "sglang-router cache_aware"}
    assert {r["system"] for r in runs} == systems
    loads = 0.0
    for run in runs:
        assert run["workload"] == "lora" and run["load"] == 0.85
        assert run["adapters"] == 8 and run["max_loaded_loras"] == 4
        assert run["workload_params"]["distinct_adapters_used"] > 4  # more than one worker holds
        # every worker reports its adapter loads and evictions over the run
        for worker in run["per_worker"]:
            assert worker["lora_loads"] >= 0 and worker["lora_evictions"] >= 0
        loads += sum(w["lora_loads"] for w in run["per_worker"])
        # the floors pay the adapter loads no router avoids (the sim's, time-scaled)
        load_s = run["floor_model"]["lora_load_s"]
        assert load_s == pytest.approx(0.052 * run["time_scale"], rel=0.01)
        assert run["queue_floor_ttft_p99_s"] >= run["floor_ttft_p99_s"]
        # every run but the first starts from the adapters the workers loaded at start: the
        # run before left others, which were unloaded and the start's loaded again
        assert run["lora_reloads"] >= 0
    assert sum(r["lora_reloads"] for r in runs) > 0
    assert loads > 0  # 8 adapters on workers that hold 4: someone loaded one
    setup = next(iter(figures["setup"].values()))
    assert setup["instance_kv_tokens"] <= setup["hot_set_tokens"] / 2
    (config,) = figures["lora"]
    rows = {row["system"]: row for row in figures["lora"][config]}
    assert set(rows) == systems
    for system, row in rows.items():
        assert set(row["seeds"]) == {1}
        for key in ("ttft_mean_s", "ttft_p99_s", "hit_ratio", "lora_loads_per_request"):
            assert finite(row[key]["1"]), (system, key)
        theirs = rows["sglang-router cache_aware"]["ttft_p99_s"]["1"]
        assert row["p99_vs_cache_aware"]["1"] == pytest.approx(row["ttft_p99_s"]["1"] / theirs)
    (target,) = figures["targets"]
    assert target.endswith("ours_prompt_tree_p99_vs_cache_aware")
    assert figures["targets"][target]["limit"] == 0.7
    # the adapter-affinity peer routes by adapter alone: every decision names the adapter
    (affinity,) = [r for r in runs if r["system"] == "ours lora_affinity"]
    reasons = affinity["router_decisions"]
    assert set(reasons) & {"reason:adapter_loaded", "reason:adapter_slot"}, reasons
    assert "reason:no_adapter" not in reasons or reasons["reason:no_adapter"] <= 1  # the probe
    check_report(lora_dir, figures)
    md = (lora_dir / "results.md").read_text()
    assert "## Adapters and latency" in md and "adapter loads / request" in md


def test_lora_workload_names_zipf_popular_adapters_with_their_own_prefixes() -> None:
    vocab = Words()
    workload = LoraPrefix(requests=400, seed=3).build(vocab)  # type: ignore[arg-type]
    requests = workload.requests
    assert all(r.lora is not None and r.prompt and r.prompt_ids for r in requests)
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.lora or ""] = counts.get(r.lora or "", 0) + 1
    assert set(counts) <= {adapter_name(k) for k in range(20)}
    ranked = sorted(counts.values(), reverse=True)
    assert ranked[0] / len(requests) > 0.15 and len(counts) >= 12  # Zipf(1) of 20: ~28% top
    assert workload.params["hottest_adapter_share"] == ranked[0] / len(requests)
    # one adapter's requests share its system prompt; two adapters share no first page
    by_adapter: dict[str, list[list[int]]] = {}
    for r in requests:
        by_adapter.setdefault(r.lora or "", []).append(r.prompt_ids or [])
    firsts = {name: prompts[0][:16] for name, prompts in by_adapter.items()}
    assert len({tuple(f) for f in firsts.values()}) == len(firsts)
    system = LoraPrefix().system_min_tokens
    for prompts in by_adapter.values():
        assert all(p[:system] == prompts[0][:system] for p in prompts)
    # the same seed, the same plan; the Poisson arrivals at the rate asked for
    again = LoraPrefix(requests=400, seed=3).build(vocab).requests  # type: ignore[arg-type]
    assert [(r.lora, r.prompt_ids, r.at_s) for r in again] == [
        (r.lora, r.prompt_ids, r.at_s) for r in requests
    ]
    assert 0.8 * 100 < requests[-1].at_s < 1.2 * 100  # 400 requests at 4/s


def test_bodies_name_the_adapter_by_lora_path() -> None:
    sent = json.loads(body(COMPLETIONS, "hi", 4, model="m", lora_path="lora03"))
    assert sent["model"] == "m" and sent["lora_path"] == "lora03"
    assert json.loads(body(GENERATE, "hi", 4, lora_path="lora03"))["lora_path"] == "lora03"
    assert "lora_path" not in json.loads(body(COMPLETIONS, "hi", 4, model="m"))


def test_workers_register_every_adapter_and_hold_four() -> None:
    args = lora_preset.worker_args(LoraPrefix())
    paths = args[args.index("--lora-paths") + 1 : args.index("--max-loaded-loras")]
    assert paths == tuple(f"lora{k:02d}=/adapters/lora{k:02d}" for k in range(20))
    assert args[args.index("--max-loaded-loras") + 1] == "4"
    assert args[args.index("--max-loras-per-batch") + 1] == "4"
    info = {"lora": {"loads": 7, "evictions": 3, "adapters": [{"lora_name": "a"}]}}
    assert lora_counters(info) == {"lora_loads": 7.0, "lora_evictions": 3.0}
    assert lora_counters({}) == {} and lora_counters({"lora": {"adapters": []}}) == {}
    names = {s.name for s in lora_preset.full_preset().systems}
    assert names == {
        "ours prompt_tree",
        "ours prompt_tree lora-load 0",
        "ours lora_affinity",
        "sglang-router cache_aware",
        "sglang-router round_robin",
    }


def test_a_worker_gets_back_the_adapters_it_started_with(tmp_path: Path, model_dir: Path) -> None:
    """A run leaves the adapters its router placed; `reset_adapters` unloads and loads them
    again so that the next system meets the start's, in their order."""
    builder = LoraPrefix(adapters=4)
    spec = ClusterSpec(
        "reset",
        colocated=1,
        time_scale=0,
        worker_args=(
            *lora_preset.worker_args(builder)[:5],
            "--max-loaded-loras",
            "2",
            "--max-loras-per-batch",
            "2",
        ),
    )
    cluster = Cluster.create(spec, model_dir, tmp_path, None)
    try:
        (url,) = cluster.start()
        assert cluster.adapters_at_start == {url: ["lora00", "lora01"]}
        assert cluster.reset_adapters() == 0  # nothing moved: nothing reloaded
        for name in ("lora03", "lora02"):  # evicts both of the start's
            body = {"model": "default", "prompt": "hi", "max_tokens": 1, "lora_path": name}
            status, answer = call(url + "/v1/completions", body)
            assert status == 200, answer
        assert adapters.resident(cluster.server_info()[0]) == ["lora02", "lora03"]
        assert cluster.reset_adapters() == 4  # the two placed, then the start's two
        info = cluster.server_info()[0]
        assert adapters.resident(info) == ["lora00", "lora01"]
        names = [a.name for a in adapters.registered(info)]
        assert sorted(names) == [f"lora{k:02d}" for k in range(4)]  # all still registered
        # and in the start's order: the first of them is evicted first
        body = {"model": "default", "prompt": "hi", "max_tokens": 1, "lora_path": "lora03"}
        assert call(url + "/v1/completions", body)[0] == 200
        assert sorted(adapters.resident(cluster.server_info()[0])) == ["lora01", "lora03"]
    finally:
        cluster.stop()

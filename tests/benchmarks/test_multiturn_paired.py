"""The paired presets, `--hot-prefix` and `--pd`: their quick variants end to end, and the
parts (workload, sustained-rate search, per-worker figures, targets) on their own.

As for the other presets, only structure and sanity are asserted of the runs: every system
of a config got the same requests at the rate measured on its cluster, answered them all,
and the report says which targets were met and why not; timings are not thresholds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.runs import PNG_MAGIC, benchmark, check_prediction_column, finite


def quick(tmp_path_factory: pytest.TempPathFactory, flag: str) -> Path:
    out = tmp_path_factory.mktemp(flag.strip("-"))
    done = benchmark("multiturn", out, flag, "--quick", timeout=360)
    assert done.returncode == 0, f"benchmark failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def hot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quick(tmp_path_factory, "--hot-prefix")


@pytest.fixture(scope="module")
def pd_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quick(tmp_path_factory, "--pd")


def figures_of(out: Path) -> dict[str, Any]:
    figures = json.loads((out / "results.json").read_text())
    assert isinstance(figures, dict)
    return figures


def check_paired_run(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """What holds for any paired run: same requests per config at load x the measured
    sustained rate, every request answered, the tokens split, shares that add up."""
    runs = [r for r in figures["runs"] if r["available"]]
    assert runs
    for config in {r["config"] for r in runs}:
        mine = [r for r in runs if r["config"] == config]
        calibration = figures["calibration"][config]
        sustained = calibration["sustained_rps"]
        assert finite(sustained) and sustained > 0, calibration
        assert calibration["steps"] and calibration["stopped"], calibration
        assert sustained <= 1.5 * calibration["floor_bound_rps"], calibration
        for seed in {r["seed"] for r in mine}:
            same = [r for r in mine if r["seed"] == seed]
            assert len({r["oracle_prompt_tokens"] for r in same}) == 1, config  # same requests
            assert len({r["requests"] for r in same}) == 1, config
        for run in mine:
            where = f"{run['system']} on {run['cluster']}"
            assert run["rate"] == pytest.approx(run["load"] * sustained), where
            assert run["errors"] == 0 and not run.get("warmup_errors"), run["error_samples"]
            parts = ("device_tokens", "host_tokens", "pulled_tokens", "recomputed_tokens")
            assert sum(run[k] for k in parts) == run["prompt_tokens"], where
            assert run["reuse_ratio"] <= run["oracle_hit_ratio"] + 1e-9, where
            assert len(run["ttft_samples_s"]) == run["completed"], where
            assert run["ttft_samples_s"] == sorted(run["ttft_samples_s"]), where
            assert len(run["worker_roles"]) == len(run["gpu_busy_s"]) == len(run["per_worker"])
    for entry in figures["summary"]:
        roles = entry["worker_roles"]
        for key in ("request_shares", "busy_shares"):
            for role in set(roles):
                total = sum(s for s, r in zip(entry[key], roles, strict=True) if r == role)
                assert total == pytest.approx(1.0), (entry["system"], key, role)
    for name, t in figures["targets"].items():
        assert {"value", "limit", "met", "spread", "per_seed", "detail"} <= set(t), name
        if t["met"] is not True:
            assert t.get("why"), f"{name} missed without a reason"
    return runs


def check_report(out: Path, figures: dict[str, Any]) -> None:
    md = (out / "results.md").read_text()
    for heading in ("## Targets", "## Sustained rate", "## Notes", "## Machine"):
        assert heading in md, heading
    for text in (
        "floor p99",
        "LRU queued p99",
        "written back",
        "busy per worker",
        "prefill",
        "µs/token",
    ):
        assert text in md, text
    assert "/work/" not in md and figures["command"].startswith("python -m benchmarks.multiturn")
    check_prediction_column(md)
    for name in ("ttft_cdf.png", "worker_busy.png"):
        assert name in figures["plots"]
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_hot_prefix_quick(hot_dir: Path) -> None:
    figures = figures_of(hot_dir)
    assert figures["preset"] == "hot-prefix-quick"
    runs = check_paired_run(figures)
    assert {r["system"] for r in runs} == {
        "ours prompt_tree",
        "sglang-router cache_aware",
        "sglang-router round_robin",
    }
    for run in runs:
        assert run["workload"] == "hot_prefix" and run["api"] == "openai"
        assert run["load"] == 0.85 and run["worker_roles"] == ["colocated"] * 4
        # the LRU reference: the workers' own caches, so no more than the oracle reuses,
        # and its queue waits at least as long as the oracle's
        assert 0 < run["lru_hit_ratio"] <= run["oracle_hit_ratio"] + 1e-9
        assert run["lru_queue_floor_ttft_p99_s"] >= run["queue_floor_ttft_p99_s"] - 1e-9
    setup = next(iter(figures["setup"].values()))
    assert setup["instance_kv_tokens"] <= setup["hot_set_tokens"] / 2  # the hot set: 2 workers
    names = set(figures["targets"])
    for name in ("p99_vs_cache_aware", "p99_vs_round_robin", "p99_vs_floor", "mean_vs_round_robin"):
        assert f"hot_prefix_4_colocated_ours_prompt_tree_{name}" in names
    assert "hot_prefix_4_colocated_ours_prompt_tree_busy_balance" in names
    check_report(hot_dir, figures)


def test_pd_quick(pd_dir: Path) -> None:
    figures = figures_of(pd_dir)
    assert figures["preset"] == "pd-quick"
    runs = check_paired_run(figures)
    by_mode = {(r["system"], r["pd_caching"]) for r in runs}
    assert by_mode == {
        ("ours prompt_tree", "caching-1"),
        ("sglang-router PD cache_aware/power_of_two", "caching-1"),
        ("ours prompt_tree", "caching-3"),
    }
    for run in runs:
        roles = run["worker_roles"]
        assert roles == ["prefill", "prefill", "decode", "decode"]
        decodes = [w for w, r in zip(run["per_worker"], roles, strict=True) if r == "decode"]
        prefills = [w for w, r in zip(run["per_worker"], roles, strict=True) if r == "prefill"]
        assert sum(w["pd_bytes_sent"] for w in prefills) > 0  # every prompt's KV moved
        written = sum(w["written_back"] for w in decodes)
        if run["pd_caching"] == "caching-3":  # the decode writes back after each answer
            assert written > 0 and sum(w["pd_bytes_sent"] for w in decodes) > 0
            # later turns reuse the answers' pages at the prefill, and the answers say so
            assert 0 < run["written_back_tokens"] <= run["device_tokens"] + run["host_tokens"]
        else:
            assert written == 0 and sum(w["pd_bytes_sent"] for w in decodes) == 0
            assert run["written_back_tokens"] == 0
    targets = figures["targets"]
    for name in ("mean_vs_sglang_pd", "p99_vs_sglang_pd", "hit_vs_sglang_pd"):
        assert f"multi_round_qa_2p2d_2x_ours_prompt_tree_pd_caching_3_{name}" in targets
    check_report(pd_dir, figures)
    lines = (pd_dir / "results.md").read_text().splitlines()
    header = next(i for i, ln in enumerate(lines) if "| written back |" in ln)
    column = [c.strip() for c in lines[header].split("|")].index("written back")
    row = next(ln for ln in lines[header:] if "[PD-Caching-3] |" in ln)
    assert row.split("|")[column].strip().endswith("%")  # the written-back share is reported


def test_paired_report_only(hot_dir: Path, tmp_path: Path) -> None:
    """--report-only makes the same targets and summary from results.json alone."""
    figures = figures_of(hot_dir)
    copy = tmp_path / "again"
    copy.mkdir()
    (copy / "results.json").write_text((hot_dir / "results.json").read_text())
    done = benchmark("multiturn", copy, "--report-only", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    again = figures_of(copy)
    assert again["runs"] == figures["runs"] and again["calibration"] == figures["calibration"]
    assert again["targets"] == figures["targets"] and again["summary"] == figures["summary"]
    assert (copy / "results.md").read_text().split("## Notes")[0] == (
        (hot_dir / "results.md").read_text().split("## Notes")[0]
    )


# --------------------------------------------------------------------------- the parts


class Words:
    """A stand-in vocabulary: word i is token i."""

    def words_text(self, rng: Any, n: int) -> tuple[str, list[int]]:
        ids = [rng.randrange(1000) for _ in range(n)]
        return "".join(f" w{i}" for i in ids), ids


def test_hot_prefix_workload_has_zipf_popular_shared_prefixes() -> None:
    from benchmarks.multiturn.hot_prefix import HotPrefix, zipf_weights
    from benchmarks.multiturn.working_set import hot_set_tokens

    weights = zipf_weights(100, 1.1)
    assert sum(weights) == pytest.approx(1.0) and weights == sorted(weights, reverse=True)
    assert weights[0] / weights[9] == pytest.approx(10**1.1)
    hp = HotPrefix(prefixes=50, prefix_min_tokens=64, prefix_max_tokens=128, requests=2000)
    workload = hp.build(Words())  # type: ignore[arg-type]
    requests = workload.requests
    assert len(requests) == 2000 and all(r.parent is None for r in requests)
    assert all(r.route == "completion" and r.max_tokens == 32 for r in requests)
    assert requests[-1].at_s / len(requests) == pytest.approx(1 / hp.rate, rel=0.1)  # Poisson
    heads: dict[tuple[int, ...], int] = {}
    for r in requests:
        ids = r.prompt_ids or []
        assert 64 + 20 <= len(ids) <= 128 + 400
        heads[tuple(ids[:64])] = heads.get(tuple(ids[:64]), 0) + 1
    counts = sorted(heads.values(), reverse=True)
    assert len(counts) <= 50
    assert counts[0] / 2000 == pytest.approx(zipf_weights(50, 1.1)[0], abs=0.03)  # the hottest
    assert workload.params["hottest_prefix_share"] == counts[0] / 2000
    again = hp.build(Words())  # type: ignore[arg-type]
    assert [r.prompt_ids for r in again.requests] == [r.prompt_ids for r in requests]
    assert hot_set_tokens(workload) % 16 == 0
    assert hot_set_tokens(workload) <= 50 * 128  # no suffix is shared


def test_open_loop_trace_sends_independent_windows(tmp_path: Path, model_dir: Path) -> None:
    from benchmarks.multiturn.text import Vocab
    from benchmarks.multiturn.trace import OpenLoopTrace
    from shared.tokenizer import ChatTokenizer

    rows = [
        {"timestamp": 100 * i, "input_length": 600, "output_length": 9, "hash_ids": [0, i]}
        for i in range(10)
    ]
    path = tmp_path / "agent.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    vocab = Vocab.from_tokenizer(ChatTokenizer(model_dir))
    first = OpenLoopTrace(path, requests=4, rate=2.0, seed=1).build(vocab)
    second = OpenLoopTrace(path, requests=4, rate=2.0, seed=2).build(vocab)
    assert first.name == "trace:agent" and first.params["open_loop"] is True
    assert all(r.parent is None and r.turn == 0 for r in first.requests)
    assert [r.at_s for r in first.requests] == pytest.approx([0, 2 / 3, 4 / 3, 2])
    assert first.requests[0].prompt_ids != second.requests[0].prompt_ids  # another window
    assert (first.requests[0].prompt_ids or [])[:512] == (first.requests[1].prompt_ids or [])[:512]
    last = OpenLoopTrace(path, requests=4, rate=2.0, seed=3).build(vocab)  # past the end
    assert len(last.requests) == 4


def test_the_search_finds_where_completions_stop_growing() -> None:
    from benchmarks.multiturn.sustained import Search, search

    def cluster(capacity: float) -> Any:
        def run_at(rate: float) -> dict[str, Any]:
            return {"throughput_rps": min(rate, capacity), "offered_rps": rate, "errors": 0}

        return run_at

    found = search(cluster(5.0), 10.0, 2.0, Search())
    assert found.sustained_rps == pytest.approx(5.0)
    assert [s["offered_rps"] for s in found.steps] == pytest.approx([2, 2.8, 3.92, 5.488, 7.6832])
    assert "fell behind" in found.stopped
    flat = search(cluster(5.0), 10.0, 2.0, Search(behind=0.5))  # keeps up, stops growing
    assert flat.sustained_rps == pytest.approx(5.0) and "stopped growing" in flat.stopped
    behind = search(cluster(5.0), 10.0, 8.0, Search())  # overloaded at once: back off
    assert [s["offered_rps"] for s in behind.steps] == pytest.approx([8.0, 4.5, 6.3])
    assert behind.sustained_rps == pytest.approx(5.0) and "fell behind" in behind.stopped
    slow = search(cluster(100.0), 200.0, 1.0, Search(max_steps=3))
    assert slow.sustained_rps == pytest.approx(1.96) and "without both" in slow.stopped

    def failing(rate: float) -> dict[str, Any]:
        return {"throughput_rps": rate, "errors": 2, "error_samples": ["HTTP 502"]}

    broken = search(failing, None, 1.0, Search())
    assert broken.sustained_rps is None and "errors" in broken.stopped
    refused = search(
        lambda r: {"available": False, "reason": "failed to start"}, 2.0, 1.0, Search()
    )
    assert refused.sustained_rps is None and "did not run: failed to start" in refused.stopped


def paired_run(
    system: str, seed: int, p99: float, mean: float, busy: list[float]
) -> dict[str, Any]:
    return {
        "system": system,
        "router": "memserve-router" if system.startswith("ours") else "sglang-router",
        "available": True,
        "config": "hot_prefix, 4 colocated",
        "cluster": "c",
        "pd_caching": None,
        "seed": seed,
        "ttft_p99_s": p99,
        "ttft_mean_s": mean,
        "floor_ttft_p99_s": 1.0,
        "reuse_ratio": 0.5,
        "errors": 0,
        "requests": 100,
        "worker_roles": ["colocated"] * len(busy),
        "gpu_busy_s": busy,
        "per_worker": [{"requests": 25.0} for _ in busy],
    }


def test_paired_targets_are_taken_within_a_seed() -> None:
    from benchmarks.multiturn.hot_prefix_preset import targets_for
    from benchmarks.multiturn.paired_report import busy_balance, evaluate, summarize

    ours, ca, rr = "ours prompt_tree", "sglang-router cache_aware", "sglang-router round_robin"
    runs = [
        paired_run(ours, 1, 1.0, 0.5, [10, 10, 10, 2]),
        paired_run(ours, 2, 3.0, 0.5, [10, 10, 10, 10]),
        paired_run(ca, 1, 2.0, 0.5, [10, 10, 10, 10]),
        paired_run(ca, 2, 4.0, 0.5, [10, 10, 10, 10]),
        paired_run(rr, 1, 1.0, 1.0, [10, 10, 10, 10]),
        paired_run(rr, 2, 2.0, 0.5, [10, 10, 10, 10]),
    ]
    assert busy_balance(runs[0]) == pytest.approx(2 / 8)
    summary = summarize(runs)
    targets = evaluate(runs, summary, targets_for)
    prefix = "hot_prefix_4_colocated_ours_prompt_tree_"
    vs_ca = targets[prefix + "p99_vs_cache_aware"]
    assert vs_ca["per_seed"] == pytest.approx({1: 0.5, 2: 0.75})
    assert vs_ca["value"] == pytest.approx(0.625) and vs_ca["met"] is False
    assert "requests" in vs_ca["why"] and "busy" in vs_ca["why"]
    floor = targets[prefix + "p99_vs_floor"]
    assert floor["per_seed"] == pytest.approx({1: 1.0, 2: 3.0}) and floor["met"] is False
    mean = targets[prefix + "mean_vs_round_robin"]
    assert mean["per_seed"] == pytest.approx({1: 0.5, 2: 1.0}) and mean["met"] is True
    balance = targets[prefix + "busy_balance"]
    assert balance["spread"] == pytest.approx([0.25, 1.0]) and balance["value"] == 0.625
    assert not any(name.startswith("hot_prefix_4_colocated_ours_cost") for name in targets)
    runs[2]["errors"] = 1  # a failed request makes a figure no measurement
    assert (
        evaluate(runs, summarize(runs), targets_for)[prefix + "p99_vs_cache_aware"]["met"] is None
    )


def test_pd_systems_name_their_policies_and_flags() -> None:
    from benchmarks.multiturn.cluster import router_args
    from benchmarks.multiturn.pd_preset import PD_CACHE_AWARE, PROMPT_TREE
    from localrun.cluster import Cluster, ClusterSpec, Worker
    from localrun.processes import Launch

    assert PD_CACHE_AWARE.name == "sglang-router PD cache_aware/power_of_two"
    spec = ClusterSpec("t", prefills=1, decodes=1, caching="caching-1")
    workers = [
        Worker(Launch("p", [], 1, Path("p.log")), "prefill", 9001),
        Worker(Launch("d", [], 2, Path("d.log")), "decode"),
    ]
    cluster = Cluster(spec, workers, Path("model"))
    args = router_args(PD_CACHE_AWARE, cluster, 3000)
    assert "--pd-disaggregation" in args
    for flag, value in (("--prefill-policy", "cache_aware"), ("--decode-policy", "power_of_two")):
        assert args[args.index(flag) + 1] == value
    assert args[args.index("--prefill") + 2] == "9001"
    ours = router_args(PROMPT_TREE, cluster, 3000)
    assert ours[ours.index("--pd-caching") + 1] == "caching-1"
    assert "--prefill-policy" not in ours  # ours: --policy for both sides
    colocated = Cluster(ClusterSpec("c", colocated=1), workers[:1], Path("model"))
    assert "--prefill-policy" not in router_args(PD_CACHE_AWARE, colocated, 3000)


def test_one_decode_gets_a_policy_the_peers_accept() -> None:
    """sglang-router refuses power_of_two over one decode: 3P1D runs round_robin there, and
    the targets compare with that run."""
    from benchmarks.multiturn.pd_preset import PD_CACHE_AWARE, baseline, for_shape

    assert for_shape(PD_CACHE_AWARE, 2) is PD_CACHE_AWARE
    assert for_shape(PD_CACHE_AWARE, 1).name == "sglang-router PD cache_aware/round_robin"
    assert baseline("trace, 3P1D, 4x") == "sglang-router PD cache_aware/round_robin [PD-Caching-1]"
    assert baseline("trace, 2P2D, 2x").endswith("cache_aware/power_of_two [PD-Caching-1]")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hot-prefix", "--pd"], "pick one"),
        (["--hot-prefix", "--multiples", "2"], "--multiples belongs to --capacity and --pd"),
        (["--calibration-from", "x"], "--calibration-from belongs to"),
        (["--pd", "--max-total-tokens", "4096"], "sizes the KV from the working set"),
        (["--capacity", "--shapes", "2P2D"], "--shapes belongs to --hot-prefix and --pd"),
        (["--hot-prefix", "--quick", "--shapes", "3P1D"], "this preset has ['4 colocated']"),
    ],
)
def test_paired_command_line_errors(tmp_path: Path, args: list[str], message: str) -> None:
    done = benchmark("multiturn", tmp_path, *args, timeout=180)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_shapes_narrow_a_paired_preset() -> None:
    """--shapes keeps the preset's own order and refuses a shape it does not run."""
    from benchmarks.multiturn import hot_prefix_preset, pd_preset
    from benchmarks.multiturn.paired_cli import with_shapes

    pd = pd_preset.full_preset()
    assert with_shapes(pd, ["3P1D", "9P9D"]).shapes == ("3P1D",)
    assert with_shapes(pd, None) is pd
    hot = hot_prefix_preset.full_preset()
    assert with_shapes(hot, ["2P2D", "4 colocated"]).shapes == ("4 colocated", "2P2D")
    with pytest.raises(ValueError, match="this preset has"):
        with_shapes(hot, ["3P1D"])


def test_systems_pick_a_caching_mode_and_pd_prefills_pull(model_dir: Path) -> None:
    """`--systems` with a label runs that caching mode's cluster only, the name every mode's;
    a PD preset with pulls starts its caching prefills with them, never a PD-Basic one."""
    from dataclasses import replace

    from benchmarks.multiturn import pd_preset
    from benchmarks.multiturn.capacity import Features
    from benchmarks.multiturn.text import Vocab
    from shared.token_cache import CachedEncoder
    from shared.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    vocab, encoder = Vocab.from_tokenizer(tokenizer), CachedEncoder(tokenizer)
    features = Features(host_tier=True, pulls=True, no_pull_router=True, kv_events=True)

    def clusters(systems: set[str] | None, pulls: bool) -> dict[str, tuple[bool, list[str]]]:
        preset = replace(pd_preset.quick_preset(), modes=pd_preset.MODES, pulls=pulls)
        plan = pd_preset.make_plan(preset, vocab, encoder, features, None, systems)
        members = [m for config in plan.configs for m in config.members]
        return {
            m.spec.caching or "": (m.spec.mempool_pull, [s.name for s in m.systems])
            for m in members
        }

    every = clusters({"ours prompt_tree"}, pulls=True)
    assert set(every) == {"caching-1", "caching-3", "basic"}
    assert every["caching-3"][0] and every["caching-1"][0] and not every["basic"][0]
    assert clusters({"ours prompt_tree [PD-Caching-3]"}, pulls=True) == {
        "caching-3": (True, ["ours prompt_tree"])
    }
    assert not any(pull for pull, _ in clusters(None, pulls=False).values())


def test_systems_pick_the_hot_prefix_presets_decodes_cache_cluster_alone(model_dir: Path) -> None:
    """`--systems 'ours prompt_tree [PD-Caching-2]'` on the hot-prefix preset runs that
    cluster alone (it was refused as naming no system of the preset)."""
    from dataclasses import replace

    from benchmarks.multiturn import hot_prefix_preset as hp
    from benchmarks.multiturn.capacity import Features
    from benchmarks.multiturn.text import Vocab
    from shared.tokenizer import ChatTokenizer

    vocab = Vocab.from_tokenizer(ChatTokenizer(model_dir))
    features = Features(host_tier=False, pulls=True, no_pull_router=False, kv_events=True)
    preset = replace(hp.quick_preset(), shapes=(hp.PD_2P2D,), systems=hp.SYSTEMS)

    def clusters(systems: set[str]) -> dict[str, list[str]]:
        plan = hp.make_plan(preset, vocab, features, systems)
        members = [m for config in plan.configs for m in config.members]
        return {m.spec.caching or "": [s.name for s in m.systems] for m in members}

    assert clusters({"ours prompt_tree [PD-Caching-2]"}) == {"caching-2": ["ours prompt_tree"]}
    assert clusters({"ours prompt_tree"}) == {
        "caching-1": ["ours prompt_tree"],
        "caching-2": ["ours prompt_tree"],
    }
    with pytest.raises(ValueError, match="nothing"):
        clusters({"ours cost [PD-Caching-2]"})


def test_a_run_of_some_seeds_sizes_the_kv_as_the_run_its_rates_came_from(
    model_dir: Path, tmp_path: Path
) -> None:
    """`--calibration-from DIR` takes DIR's KV sizing too: a preset's seeds split over
    several invocations run on the KV the whole preset would, not one sized by each
    invocation's own seeds."""
    import json
    from dataclasses import replace

    from benchmarks.multiturn import hot_prefix_preset as hp
    from benchmarks.multiturn import pd_preset
    from benchmarks.multiturn.capacity import Features
    from benchmarks.multiturn.paired import known_from
    from benchmarks.multiturn.text import Vocab
    from shared.token_cache import CachedEncoder
    from shared.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    vocab, encoder = Vocab.from_tokenizer(tokenizer), CachedEncoder(tokenizer)
    features = Features(host_tier=False, pulls=True, no_pull_router=False, kv_events=True)

    hot = replace(hp.quick_preset(), shapes=(hp.PD_2P2D,), systems=hp.SYSTEMS)
    own = hp.make_plan(hot, vocab, features)
    key = own.configs[0].key
    mine = own.setup[key]
    source = tmp_path / "earlier"
    source.mkdir()
    earlier = {key: {**mine, "hot_set_tokens": 2 * mine["hot_set_tokens"]}, "bad": 3}
    calibration = {key: {"sustained_rps": 1.5, "stopped": "the cluster fell behind"}}
    (source / "results.json").write_text(json.dumps({"setup": earlier, "calibration": calibration}))
    rates, known = known_from(source)
    assert rates == {key: 1.5} and set(known) == {key}
    split = hp.make_plan(hot, vocab, features, known=known).setup[key]
    assert split["hot_set_tokens"] == 2 * mine["hot_set_tokens"]
    assert split["instance_kv_tokens"] > 1.9 * mine["instance_kv_tokens"]
    assert "as the run the rates came from sized it" in split["text"]

    pd = pd_preset.quick_preset()
    own = pd_preset.make_plan(pd, vocab, encoder, features)
    key = own.configs[0].key
    working_set = own.setup[key]["working_set_sizing"]
    known = {key: {"working_set_sizing": 3 * working_set}}
    split = pd_preset.make_plan(pd, vocab, encoder, features, known=known).setup[key]
    assert split["working_set_sizing"] == 3 * working_set
    assert split["instance_kv_tokens"] > 2.9 * own.setup[key]["instance_kv_tokens"]

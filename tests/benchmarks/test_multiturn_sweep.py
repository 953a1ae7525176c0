"""The robustness sweep (`--sweep`, issue 37): its quick preset end to end (files and fields,
not the ratios), and its parts on their own: the one-factor-at-a-time cells, chats of the
hot-prefix workload, per-worker engine speeds, and cells that share a sustained rate.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.benchmarks.runs import PNG_MAGIC, REPO_ROOT, benchmark, finite
from tests.benchmarks.test_multiturn_paired import Words, check_paired_run

SYSTEMS = {
    "ours prompt_tree",
    "ours cost",
    "sglang-router cache_aware",
    "sglang-router round_robin",
}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    done = benchmark("multiturn", out, "--sweep", "--quick", timeout=360)
    assert done.returncode == 0, f"benchmark failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return out


def test_sweep_quick(sweep_dir: Path) -> None:
    figures = json.loads((sweep_dir / "results.json").read_text())
    assert figures["preset"] == "sweep-quick"
    command = figures["command"]
    assert command.startswith("python -m benchmarks.multiturn") and "--sweep --quick" in command
    runs = check_paired_run(figures)
    cells = ["base", "engines mixed"]
    assert list(dict.fromkeys(r["config"] for r in runs)) == cells
    for cell in cells:
        mine = [r for r in runs if r["config"] == cell]
        assert {r["system"] for r in mine} == SYSTEMS and {r["seed"] for r in mine} == {1}
        for run in mine:
            assert run["sweep_cell"]["name"] == cell and run["load"] == 0.85
            assert run["worker_roles"] == ["colocated"] * 4
            if cell == "engines mixed":  # two workers at H100 speed, two 4x slower
                assert run["worker_time_scales"] == [1, 1, 4, 4]
            else:
                assert "worker_time_scales" not in run and run["time_scale"] == 1
            if run["router"] == "memserve-router":
                decisions = run["router_decisions"]
                assert decisions["reported_cached_tokens"] > 0, decisions
    assert figures["setup"]["engines mixed"]["time_scales"] == [1, 1, 4, 4]

    sweep = figures["sweep"]
    assert [c["cell"] for c in sweep["cells"]] == cells
    for row in sweep["cells"]:
        assert finite(row["sustained req/s"]) and finite(row["offered req/s"])
        assert row["KV/worker"] <= row["hot set"] / 2
    rows = sweep["rows"]
    assert {(r["cell"], r["system"]) for r in rows} == {(c, s) for c in cells for s in SYSTEMS}
    for row in rows:
        assert finite(row["TTFT mean s"]) and finite(row["TTFT p99 s"]) and row["hit"].endswith("%")
        if row["system"] == "sglang-router cache_aware":
            assert row["mean/CA"] is None and row["mean_vs_cache_aware_per_seed"] == {}
            continue
        for name in ("mean", "p99"):
            per_seed = row[f"{name}_vs_cache_aware_per_seed"]
            assert set(per_seed) == {"1"} and row[f"{name}/CA"] == pytest.approx(
                per_seed["1"], abs=0.005
            )
            assert row[f"{name}/CA per seed"] == f"{per_seed['1']:.2f}"
        if row["system"].startswith("ours"):  # the trees' prediction of the cached tokens
            assert finite(row["predicted/reported cached"]), row
            its = [r for r in runs if (r["config"], r["system"]) == (row["cell"], row["system"])]
            if "worker_predicted_hit_tokens" in its[0]["router_decisions"]:
                assert 0 <= row["foreseen/reported cached"] <= 1, row
    heat = sweep["heatmap"]
    assert heat["cells"] == cells
    assert heat["columns"] == ["prompt_tree mean", "prompt_tree p99", "cost mean", "cost p99"]
    assert all(len(v) == 4 and all(finite(x) for x in v) for v in heat["values"])
    assert [len(m) for m in heat["missed"]] == [4, 4]

    targets = figures["targets"]
    for cell in ("base", "engines_mixed"):
        for ours in ("ours_prompt_tree", "ours_cost"):
            for name in ("mean_vs_cache_aware", "p99_vs_cache_aware", "hot_p99_vs_cache_aware"):
                assert f"{cell}_{ours}_{name}" in targets
            mixed = f"{cell}_{ours}_mixed_mean_vs_cache_aware"
            assert (mixed in targets) == (cell == "engines_mixed")
    assert len(targets) == 14
    for name, t in targets.items():
        assert t["met"] in (True, False), name  # every run answered: all measured
        assert t["met"] or "per worker" in t["why"], name  # a miss says why

    page = (sweep_dir / "README.md").read_text()
    for heading in ("## The sweep", "## Cells", "## Targets in short", "## Targets", "## Notes"):
        assert heading in page, heading
    assert "predicted/reported cached" in page and "![sweep_heatmap.png]" in page
    assert not (sweep_dir / "results.md").exists()
    for path in (str(REPO_ROOT), str(sweep_dir), str(Path.home())):  # no machine paths
        assert path not in page, path
    for plot in ("sweep_heatmap.png", "ttft_cdf.png", "worker_busy.png"):
        assert plot in figures["plots"]
        assert (sweep_dir / plot).read_bytes()[:8] == PNG_MAGIC, plot


def test_sweep_report_only(sweep_dir: Path, tmp_path: Path) -> None:
    """--report-only makes the same sweep table, targets and heat map from results.json."""
    figures = json.loads((sweep_dir / "results.json").read_text())
    (tmp_path / "results.json").write_text((sweep_dir / "results.json").read_text())
    done = benchmark("multiturn", tmp_path, "--report-only", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["sweep"] == figures["sweep"] and again["targets"] == figures["targets"]
    assert (tmp_path / "README.md").read_text().split("## Notes")[0] == (
        (sweep_dir / "README.md").read_text().split("## Notes")[0]
    )
    assert (tmp_path / "sweep_heatmap.png").read_bytes()[:8] == PNG_MAGIC


# --------------------------------------------------------------------------- the parts


def test_sweep_cells_run_apart_merge_into_one_report(sweep_dir: Path, tmp_path: Path) -> None:
    """Cells run by two invocations (`--cells`, the same calibrations) report as one: the
    same runs, targets and table as the run that had them all; the same run twice is
    refused with a reason."""
    figures = json.loads((sweep_dir / "results.json").read_text())
    cells = sorted({r["config"] for r in figures["runs"]})
    assert len(cells) == 2
    first, second = tmp_path / "first", tmp_path / "second"
    for where, cell in ((first, cells[0]), (second, cells[1])):
        where.mkdir()
        part = {
            **figures,
            "runs": [r for r in figures["runs"] if r["config"] == cell],
            "setup": {k: v for k, v in figures["setup"].items() if k == cell},
        }
        (where / "results.json").write_text(json.dumps(part))
    done = benchmark("multiturn", first, "--report-only", "--merge", str(second), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((first / "results.json").read_text())
    assert sorted(map(json.dumps, again["runs"])) == sorted(map(json.dumps, figures["runs"]))
    assert again["targets"] == figures["targets"] and again["setup"] == figures["setup"]
    assert again["sweep"] == figures["sweep"]  # the table and heat map's figures
    assert "; " in again["command"]  # both invocations' commands
    twice = benchmark("multiturn", first, "--report-only", "--merge", str(first), timeout=120)
    assert twice.returncode == 2 and "two results hold the same run" in twice.stderr


def test_the_sweep_moves_one_factor_at_a_time() -> None:
    from dataclasses import asdict

    from benchmarks.multiturn import sweep_preset as sp

    full = sp.full_preset()
    names = [c.name for c in full.cells]
    assert names == [
        "base",
        "Zipf 0.6",
        "Zipf 1.4",
        "10 prefixes",
        "300 prefixes",
        "1K-token prefixes",
        "16K-token prefixes",
        "chats",
        "load 50%",
        "load 100%",
        "engines 4x slower",
        "engines 10x slower",
        "engines mixed",
    ]
    base = asdict(full.cells[0])
    for cell in full.cells[1:]:
        moved = {k for k, v in asdict(cell).items() if v != base[k]} - {"name", "factor"}
        assert moved == {cell.factor}, cell
    assert full.seeds == (1, 2, 3) and {s.name for s in full.systems} == SYSTEMS
    # load cells share the base's sustained rate; every other cell measures its own
    shared = [c.name for c in full.cells if c.rate_key == full.cells[0].rate_key]
    assert shared == ["base", "load 50%", "load 100%"]
    hot = [c.name for c in full.cells if c.hot]
    assert "Zipf 0.6" not in hot and "load 50%" not in hot and "load 100%" in hot
    narrow = sp.narrowed(full, [2], ["engines mixed", "base"])
    assert [c.name for c in narrow.cells] == ["base", "engines mixed"] and narrow.seeds == (2,)
    with pytest.raises(ValueError, match="this sweep has"):
        sp.narrowed(full, None, ["Zipf 9"])
    builder = full.cells[6].builder(full.sizes, 3)
    assert (builder.prefix_min_tokens, builder.prefix_max_tokens) == (12288, 20480)
    assert builder.seed == 3 and builder.requests == full.sizes.requests


def test_hot_prefix_chats_send_the_same_prefixes_as_messages() -> None:
    from dataclasses import replace

    from benchmarks.multiturn.hot_prefix import HotPrefix
    from benchmarks.multiturn.working_set import hot_set_tokens
    from benchmarks.multiturn.workloads import CHAT

    text = HotPrefix(prefixes=5, prefix_min_tokens=64, prefix_max_tokens=96, requests=40)
    chat = replace(text, route=CHAT)
    prompts = text.build(Words()).requests  # type: ignore[arg-type]
    chats = chat.build(Words()).requests  # type: ignore[arg-type]
    for p, c in zip(prompts, chats, strict=True):
        assert c.route == CHAT and c.prompt is None and not c.carry and c.parent is None
        assert c.at_s == p.at_s and c.base is not None
        assert p.prompt == " " + c.base[0]["content"] + " " + (c.user or "")

    class Encoder:
        """Chat template stand-in: a 3-token header, then each word's id."""

        def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
            words = " ".join(m["content"] for m in messages).split()
            return [1, 2, 3, *(int(w[1:]) for w in words)]

    built = chat.build(Words())  # type: ignore[arg-type]
    assert hot_set_tokens(built) == 0  # a chat's ids are the template's
    assert hot_set_tokens(built, encoder=Encoder()) > 0
    with pytest.raises(ValueError, match="route"):
        replace(text, route="generate").build(Words())  # type: ignore[arg-type]


def test_a_mixed_cluster_starts_each_worker_at_its_speed(tmp_path: Path) -> None:
    from benchmarks.multiturn import sweep_preset as sp
    from benchmarks.multiturn.capacity import Features
    from benchmarks.multiturn.cluster import router_args
    from localrun.cluster import Cluster, ClusterSpec

    features = Features(host_tier=False, pulls=True, no_pull_router=True, kv_events=False)
    mixed = sp.cluster_spec(sp.Cell("m", "engine", engine=sp.MIXED), 4096, features)
    assert mixed.scales == [1, 1, 4, 4] and mixed.time_scale == 1
    cluster = Cluster.create(mixed, tmp_path, tmp_path, None)  # (not started)
    scales = [w.launch.args[w.launch.args.index("--time-scale") + 1] for w in cluster.workers]
    assert scales == ["1", "1", "4", "4"]
    ours = router_args(sp.COST, cluster, 3000)
    assert "--prefill-secs-per-token" not in ours  # told the fast ones' speed: the defaults
    slow = sp.cluster_spec(sp.Cell("s", "engine", engine=sp.SLOW_10X), 4096, features)
    assert slow.time_scales == () and slow.scales == [10] * 4
    ours = router_args(sp.COST, Cluster.create(slow, tmp_path, tmp_path, None), 3000)
    assert "--prefill-secs-per-token" in ours
    with pytest.raises(ValueError, match="3 time scales for 4 workers"):
        _ = ClusterSpec("bad", colocated=4, time_scales=(1, 1, 4)).scales


def test_cells_that_differ_in_load_share_one_sustained_rate() -> None:
    from benchmarks.multiturn.hot_prefix import HotPrefix
    from benchmarks.multiturn.paired import Config, Member, PairedPlan, Rater
    from benchmarks.multiturn.plan import Step
    from benchmarks.multiturn.sustained import Search
    from benchmarks.multiturn.sweep_preset import COST, ROUND_ROBIN
    from localrun.cluster import ClusterSpec

    small = HotPrefix(prefixes=3, prefix_min_tokens=32, prefix_max_tokens=32, requests=5)

    def config(key: str, load: float, rate_key: str) -> Config:
        spec = ClusterSpec(f"c-{key}", colocated=1)
        member = Member(spec, (COST,))
        seeds = {1: small}
        return Config(
            key, "hot_prefix", seeds, small, (member,), ROUND_ROBIN, load, "openai", {}, rate_key
        )

    configs = [config("a", 0.85, "k"), config("b", 0.5, "k"), config("c", 0.85, "")]
    rater = Rater(SimpleNamespace(vocab=Words()), PairedPlan("t", configs, Search()))  # type: ignore[arg-type]
    measured: list[str] = []

    def measure(config: Config, *_: Any) -> float:
        measured.append(config.key)
        rater.calibrations[config.key] = {"sustained_rps": 4.0, "steps": [{}], "load": 0.85}
        return 4.0

    rater.measure = measure  # type: ignore[method-assign,assignment]
    rates = {}
    for c in configs:
        cluster = SimpleNamespace(spec=c.members[0].spec)
        step = Step(cluster.spec.name, small, (COST,), "t", 0.0, {"seed": 1})
        (done,) = rater(cluster, [step], "model", None)  # type: ignore[arg-type]
        rates[c.key] = done.rate
    assert measured == ["a", "c"]  # b took a's rate
    assert rates == pytest.approx({"a": 3.4, "b": 2.0, "c": 3.4})
    assert rater.calibrations["b"]["shared_with"] == "a"
    assert rater.calibrations["b"]["load"] == 0.5 and rater.calibrations["b"]["steps"]

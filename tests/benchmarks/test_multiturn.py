"""The multi-turn benchmark runs its --quick preset end to end and writes sane result files.

Only structure and sanity are checked (every run has the required fields, the oracle bounds
every hit ratio, a healthy cluster answers every request, the plots exist): timings on
shared machines are too noisy for thresholds, so targets are reported, never asserted. A
peer router that cannot run must be recorded with its reason. The workload builders' token
arithmetic is checked against the real tokenizer, since the oracle relies on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks.runs import PNG_MAGIC, benchmark, finite, quick_results

REQUIRED = (
    "system",
    "policy",
    "cluster",
    "workload",
    "requests",
    "errors",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "jct_mean_s",
    "jct_p99_s",
    "hit_ratio",
    "oracle_hit_ratio",
)
TARGETS = (
    "trace_hit_vs_oracle",
    "trace_p99_vs_cache_aware",
    "trace_p99_vs_round_robin",
    "multi_round_qa_hit_vs_oracle",
    "multi_round_qa_p99_vs_cache_aware",
    "multi_round_qa_p99_vs_round_robin",
    "pd_caching3_ttft_cut",
    "share_ratio_direction",
)
PLOTS = ("latency_vs_rate.png", "per_turn_ttft.png", "hit_ratio.png", "share_ratio.png", "pd.png")


out_dir, results = quick_results("multiturn", timeout=420, json_name="results")


def available(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["available"]]


def test_every_run_has_the_required_fields(results: dict[str, Any]) -> None:
    runs = results["runs"]
    assert runs
    for run in runs:
        if not run["available"]:  # a peer that cannot run here: named, with the reason
            assert run["reason"], f"{run['system']} was skipped without a reason"
            assert {"system", "policy", "cluster", "workload"} <= run.keys()
            continue
        missing = [k for k in REQUIRED if k not in run]
        assert not missing, f"{run.get('system')} on {run.get('workload')}: missing {missing}"
    ours = {r["policy"] for r in available(results) if r["router"] == "memserve-router"}
    assert {"prompt_tree", "round_robin", "session"} <= ours
    workloads = {r["workload"] for r in runs}
    assert {"trace", "multi_round_qa"} <= workloads


def test_latencies_and_ratios_are_sane(results: dict[str, Any]) -> None:
    for run in available(results):
        where = f"{run['system']} on {run['cluster']} / {run['workload']}"
        assert run["requests"] > 0, where
        assert run["completed"] + run["errors"] == run["requests"], where
        for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "jct_mean_s", "jct_p99_s"):
            assert finite(run[key]) and run[key] > 0, f"{where}: {key} = {run[key]}"
        assert run["ttft_p50_s"] <= run["ttft_p99_s"], where
        assert run["ttft_mean_s"] <= run["jct_mean_s"], where
        assert finite(run["tpot_mean_s"]) and run["tpot_mean_s"] > 0, where
        assert 0 <= run["hit_ratio"] <= 1, where
        assert 0 <= run["oracle_hit_ratio"] <= 1, where
        if run.get("gpu_utilization") is not None:  # modelled GPU time within the run's span
            assert 0 < run["gpu_utilization"] <= 1.02, f"{where}: {run['gpu_utilization']}"
        # The workers' prompt token counts equal the benchmark's own (the oracle's input).
        assert run["oracle_prompt_tokens"] == run["prompt_tokens"], where


def test_the_oracle_bounds_every_hit_ratio(results: dict[str, Any]) -> None:
    for run in available(results):
        assert run["hit_ratio"] <= run["oracle_hit_ratio"] + 1e-9, (
            f"{run['system']} on {run['workload']}: hit {run['hit_ratio']:.3f} above the "
            f"oracle's {run['oracle_hit_ratio']:.3f}"
        )


def test_a_healthy_cluster_answers_every_request(results: dict[str, Any]) -> None:
    failed = [
        f"{r['system']} on {r['cluster']} / {r['workload']}: {r['errors']} ({r['error_samples']})"
        for r in available(results)
        if r["errors"] or r.get("warmup_errors")
    ]
    assert not failed, "\n".join(failed)
    warmed = [r for r in available(results) if r["workload"] == "multi_round_qa"]
    assert warmed and all(r["warmup_requests"] > 0 for r in warmed)  # production-stack's


def test_caching_shows_where_it_should(results: dict[str, Any]) -> None:
    for run in available(results):
        if not run["radix_cache"] or run.get("pd_caching") == "basic":
            assert run["hit_ratio"] == 0, f"{run['system']} on {run['cluster']} reused KV"
    pd = [r for r in available(results) if r["group"] == "pd"]
    assert pd
    for run in pd:
        assert run["kv_bytes_moved"] > 0, f"{run['cluster']}: no KV moved"


def test_targets_are_reported_not_asserted(results: dict[str, Any]) -> None:
    targets = results["targets"]
    for name in TARGETS:
        assert name in targets, name
        t = targets[name]
        assert {"value", "limit", "met", "about"} <= set(t)
        if t["met"] is not True:
            assert t.get("why"), f"{name} missed without a reason"


def test_setup_is_recorded(results: dict[str, Any]) -> None:
    model = results["sim_model"]
    assert model["model"] and model["gpu"]
    assert results["kv_capacity_tokens"] > 0
    assert set(results["peers"]) == {"sglang-router", "smg"}


def test_markdown_and_plots(out_dir: Path, results: dict[str, Any]) -> None:
    md = (out_dir / "results.md").read_text()
    assert "## Targets" in md and "## Notes" in md and "oracle" in md
    assert "KV capacity per instance" in md
    for name in PLOTS:
        path = out_dir / name
        assert path.exists(), name
        assert path.read_bytes()[:8] == PNG_MAGIC, name
        assert name in results["plots"]


def test_trace_blocks_tokenize_as_promised(model_dir: Path) -> None:
    """A block is 512 tokens and concatenations keep the blocks' ids (the oracle's basis)."""
    from benchmarks.multiturn.text import Vocab
    from connector.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    vocab = Vocab.from_tokenizer(tokenizer)
    text, ids = vocab.blocks_prompt([0, 7, 9, 12], 3 * 512 + 100)
    assert len(ids) == 3 * 512 + 100
    assert tokenizer.encode(text) == ids
    head, head_ids = vocab.blocks_prompt([0, 7], 1024)
    assert text.startswith(head) and ids[:1024] == head_ids


def test_trace_sessions_are_causal_chains() -> None:
    from benchmarks.multiturn.trace import TraceRow, parents

    rows = [
        TraceRow(0, 1024, 10, (0, 1)),
        TraceRow(1, 1536, 10, (0, 1, 2)),
        TraceRow(2, 1024, 10, (0, 3)),
        TraceRow(3, 2048, 10, (0, 1, 2, 4)),
    ]
    assert parents(rows) == [None, 0, None, 1]


def test_any_mooncake_format_trace_replays(tmp_path: Path, model_dir: Path) -> None:
    """--trace FILE: sessions rebuilt, timestamps scaled to the rate, prompts of the
    stated lengths, a turn depending on its previous one."""
    from benchmarks.multiturn.text import Vocab
    from benchmarks.multiturn.trace import TraceReplay
    from connector.tokenizer import ChatTokenizer

    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 30, "hash_ids": [0, 2]},
        {"timestamp": 9000, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 3]},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    vocab = Vocab.from_tokenizer(ChatTokenizer(model_dir))
    workload = TraceReplay(path, sessions=0, requests=3, rate=1.0).build(vocab)
    assert workload.name == "trace:mine"
    reqs = workload.requests
    assert [len(r.prompt_ids or []) for r in reqs] == [700, 600, 1300]
    assert [r.max_tokens for r in reqs] == [20, 30, 10]
    assert reqs[2].parent == 0 and reqs[2].turn == 1 and reqs[1].parent is None
    assert reqs[2].at_s == pytest.approx(3.0)  # 3 requests at 1/s: 9 s of trace -> 3 s
    assert (reqs[2].prompt_ids or [])[:512] == (reqs[0].prompt_ids or [])[:512]  # shared block


def test_multi_round_qa_follows_production_stacks_schedule() -> None:
    """The first users are spread over their rounds and warm up first, unmeasured; a user
    never has two requests in flight; later users start cold at round 0 with their history."""
    from benchmarks.multiturn.workloads import MultiRoundQA

    class Words:
        def words_text(self, rng: Any, n: int) -> tuple[str, int]:
            return " w" * n, n

    qa = MultiRoundQA(users=8, rounds=4, qps=4.0, requests=60)
    requests = qa.build(Words()).requests  # type: ignore[arg-type]
    warmups = [r for r in requests if r.warmup]
    measured = [r for r in requests if not r.warmup]
    assert len(warmups) == 8 and len(measured) == 60
    assert sorted(r.turn for r in warmups) == [0, 0, 1, 1, 2, 2, 3, 3]  # the ramp-up
    assert all(r.parent is None and "My history:" in (r.user or "") for r in warmups)
    assert min(r.at_s for r in measured) >= max(r.at_s for r in warmups)
    by_rid = {r.rid: r for r in requests}
    for r in measured:
        if r.parent is None:  # a user who joined later: cold, from round 0
            assert r.turn == 0 and "My history:" in (r.user or "") and r.base
        else:  # the previous round of the same user, sent earlier
            parent = by_rid[r.parent]
            assert parent.session == r.session and parent.turn == r.turn - 1
            assert parent.at_s <= r.at_s and r.base is None


def test_report_only_rewrites_the_report_from_the_same_runs(
    out_dir: Path, results: dict[str, Any], tmp_path: Path
) -> None:
    """--report-only makes the report again from results.json: same runs, same machine."""
    copy = tmp_path / "again"
    copy.mkdir()
    (copy / "results.json").write_text((out_dir / "results.json").read_text())
    done = benchmark("multiturn", copy, "--report-only", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((copy / "results.json").read_text())
    assert again["runs"] == results["runs"] and again["machine"] == results["machine"]
    assert again["targets"].keys() == results["targets"].keys()
    assert "## Targets" in (copy / "results.md").read_text()
    assert all((copy / name).read_bytes().startswith(PNG_MAGIC) for name in again["plots"])


def test_report_only_without_results_is_a_clear_error(tmp_path: Path) -> None:
    done = benchmark("multiturn", tmp_path, "--report-only", timeout=60)
    assert done.returncode == 2 and "cannot read the runs from" in done.stderr, done.stderr

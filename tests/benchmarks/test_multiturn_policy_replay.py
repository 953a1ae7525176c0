"""The policy replay: a run's requests through the router's policies on a perfect view of
the cluster (FIFO queues at the floor's speed, LRU caches the policy sees exactly)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.multiturn.hot_prefix import HotPrefix
from benchmarks.multiturn.policy_replay import (
    EARLIEST,
    Replay,
    main,
    measured_figures,
    replay_results,
)
from benchmarks.multiturn.text import Vocab
from benchmarks.multiturn.workloads import COMPLETION, Request


def request(rid: int, at: float, ids: list[int], warmup: bool = False) -> Request:
    return Request(rid, f"s{rid}", 0, at, 1, COMPLETION, prompt="", prompt_ids=ids, warmup=warmup)


def per_token(n: int, cached: int) -> float:
    """A service of one second per computed token: waits are easy to read."""
    return float(n - cached)


def test_a_request_alone_waits_for_nothing_and_its_prefix_is_then_reused() -> None:
    prefix = list(range(64))
    replay = Replay("prompt_tree", 1, 10_000, per_token)
    result = replay.run([request(0, 0.0, [*prefix, 1000]), request(1, 1000.0, [*prefix, 2000])])
    # the first computes 65 tokens; the second, long after, reuses 64 (4 whole pages)
    assert result.mean_s == pytest.approx((65 + 1) / 2)
    assert result.hit == pytest.approx(64 / 130)


def test_one_worker_queues_in_arrival_order_and_warm_ups_are_not_counted() -> None:
    replay = Replay("round_robin", 1, 10_000, per_token)
    reqs = [request(0, 0.0, list(range(10)), warmup=True), request(1, 0.0, list(range(100, 120)))]
    result = replay.run(reqs)
    assert result.mean_s == pytest.approx(30.0)  # waits 10 for the warm-up, then computes 20
    assert result.p99_s == pytest.approx(30.0)


def test_an_lru_cache_of_one_prefix_evicts_the_older_one() -> None:
    a, b = list(range(160)), list(range(1000, 1160))
    replay = Replay("round_robin", 1, 160, per_token)
    result = replay.run([request(0, 0.0, a), request(1, 1e4, b), request(2, 2e4, a)])
    assert result.hit == 0.0  # b pushed a out: the third computes it again


def words() -> Vocab:
    """Single-token words as ids and strings, without a tokenizer."""
    return Vocab(list(range(1000, 3000)), [f"w{i}" for i in range(2000)], 13)


def small_hot_prefix(requests: int = 120) -> list[Request]:
    vocab = words()
    builder = HotPrefix(
        prefixes=12,
        prefix_min_tokens=512,
        prefix_max_tokens=2048,
        suffix_min_tokens=8,
        suffix_max_tokens=64,
        requests=requests,
        rate=4.0,
        seed=3,
    )
    return builder.build(vocab).requests


def test_prefix_aware_policies_reuse_more_than_round_robin_on_hot_prefixes() -> None:
    reqs = small_hot_prefix()

    def replayed(policy: str) -> Any:
        return Replay(policy, 2, 4096, lambda n, cached: (n - cached) * 1e-4).run(reqs)

    spread = replayed("round_robin")
    for policy in ("prompt_tree", "cache_aware", EARLIEST):
        assert replayed(policy).hit > spread.hit + 0.1, policy
    # the greedy reference never finishes a request later than where it was sent, so with
    # requests spread over both caches it beats a blind rotation on the tail
    assert replayed(EARLIEST).p99_s <= spread.p99_s


def test_bad_clusters_and_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="a worker and a page"):
        Replay("prompt_tree", 0, 4096, per_token)
    with pytest.raises(ValueError, match="unknown policy"):
        Replay("no_such_policy", 2, 4096, per_token)
    with pytest.raises(ValueError, match="no prompt ids"):
        Replay("round_robin", 1, 4096, per_token).run([request(0, 0.0, [])])
    with pytest.raises(ValueError, match="no measured request"):
        Replay("round_robin", 1, 4096, per_token).run([request(0, 0.0, [1] * 20, warmup=True)])


def run_record(system: str, seed: int, **extra: Any) -> dict[str, Any]:
    params: dict[str, float] = {"prefixes": 12, "prefix_min_tokens": 512}
    params |= {"prefix_max_tokens": 2048, "suffix_min_tokens": 8, "suffix_max_tokens": 64}
    params |= {"requests": 40, "rate": 4.0}
    return {
        "system": system,
        "seed": seed,
        "shape": "2 colocated",
        "workload": "hot_prefix",
        "workload_params": {**params, "seed": seed, "mean_prompt_tokens": 900.0},
        "worker_roles": ["colocated", "colocated"],
        "worker_capacity_tokens": 4096,
        "floor_model": {"chunked_prefill_size": 8192, "time_scale": 1.0},
        "ttft_mean_s": 0.5,
        "ttft_p99_s": 2.0,
        "hit_ratio": 0.4,
        **extra,
    }


def test_measured_figures_count_pulled_prefixes_as_reused() -> None:
    runs = [
        run_record("ours prompt_tree", 1, pulled_share=0.1),
        run_record("sglang-router cache_aware", 1),
        run_record("smg cache_aware", 1),  # another router: not one of the replayed policies
        run_record("ours prompt_tree", 2),
    ]
    figures = measured_figures(runs, "2 colocated", 1)
    assert set(figures) == {"prompt_tree", "cache_aware"}
    assert figures["prompt_tree"]["hit_ratio"] == pytest.approx(0.5)
    assert figures["cache_aware"]["hit_ratio"] == pytest.approx(0.4)


def test_a_results_file_is_replayed_per_seed_speed_and_policy(tmp_path: Path) -> None:
    vocab = words()
    runs = [
        run_record("ours prompt_tree", 1),
        run_record("sglang-router round_robin", 1),
        run_record("ours prompt_tree", 2, hicache_ratio=2.0),  # a host tier: not modelled
    ]
    rows = replay_results(runs, vocab, ["round_robin", "prompt_tree"], [1.0, 2.0])
    assert [(r["seed"], r["speed"], r["policy"]) for r in rows] == [
        (1, 1.0, "round_robin"),
        (1, 1.0, "prompt_tree"),
        (1, 2.0, "round_robin"),
        (1, 2.0, "prompt_tree"),
    ]
    slow, fast = rows[2], rows[0]
    assert slow["ttft_mean_s"] > fast["ttft_mean_s"]  # slower engines queue longer
    assert rows[1]["measured"]["ttft_p99_s"] == 2.0


def test_the_command_writes_its_page_and_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as missing:
        main([str(tmp_path)])
    assert missing.value.code == 2
    assert "results.json does not exist" in capsys.readouterr().err
    (tmp_path / "results.json").write_text(json.dumps({"runs": [], "command": "x"}))
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--policies", "nonsense"])
    assert "unknown policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--speeds", "0"])
    assert "--speeds must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert "no hot-prefix run to replay" in capsys.readouterr().err


def test_the_command_replays_a_results_directory(tmp_path: Path, model_dir: Path) -> None:
    runs = [run_record("ours prompt_tree", 1), run_record("sglang-router round_robin", 1)]
    (tmp_path / "results.json").write_text(json.dumps({"runs": runs, "command": "x"}))
    main([str(tmp_path), "--policies", "prompt-tree", "round_robin", "--speeds", "1"])
    data = json.loads((tmp_path / "policy_replay.json").read_text())
    assert [r["policy"] for r in data["rows"]] == ["prompt_tree", "round_robin"]
    page = (tmp_path / "policy_replay.md").read_text()
    assert "| 2 colocated | 1x the floor | prompt_tree | 1 |" in page


def test_a_replay_is_the_same_every_time() -> None:
    reqs = small_hot_prefix(60)
    results = {Replay("cache_aware", 3, 4096, per_token).run(reqs) for _ in range(3)}
    assert len(results) == 1

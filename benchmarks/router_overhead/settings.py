"""The benchmark's sizes, durations, workloads and targets, in one place."""

from __future__ import annotations

from dataclasses import dataclass

NAME = "router_overhead"
SEED = 20240623

CONV_TOKENS = 8192  # a cold chat is at least this long (tokens, chat template included)
SMALL_MAX_TOKENS = 8  # latency workloads: a short answer
RPS_MAX_TOKENS = 1

CORE_COUNTS = (1, 2)  # the CPU sets' sizes every router runs on (taskset)

# issue 34's (the decision in native code): Dynamo's indexer decides in about 10 us
TARGET_DECISION_P50_US = 10.0
TARGET_MULTI_TURN_ADDED_P50_MS = 0.7
TARGET_COLD_ADDED_P50_MS = 1.5
TARGET_RPS_RATIO = 1.0  # ours (prompt_tree, a process per core) / sglang-router (cache_aware)

WORKLOADS = ("small", "cold_8k", "multi_turn", "shared_text")
WORKLOAD_TITLES = {
    "small": "small chat (~50 tok)",
    "cold_8k": "cold 8K chat",
    "multi_turn": "multi-turn 8K (turn >= 2)",
    "shared_text": "8K text, shared prefix",
}


@dataclass(frozen=True)
class Settings:
    """Sizes and durations: quick mode trades precision for a run of about a minute."""

    quick: bool
    small_requests: int  # per system
    conversations: int  # 8K conversations per system
    turns: int  # per conversation: 1 cold turn, then turns - 1 multi-turn requests
    concurrency: int  # max requests/s: concurrent clients
    rps_warmup_s: float  # per slice, not counted
    rps_duration_s: float  # counted, per system
    rps_slices: int  # the window is run in this many slices, interleaved across systems
    tree_conversations: int  # decision time: conversations in the prompt trees
    tree_workers: int
    decision_calls: int  # timed select() calls per case
    tokenizer_conversations: int  # conversations timed for the tokenizer's cost


QUICK = Settings(
    True,
    small_requests=60,
    conversations=6,
    turns=4,
    concurrency=32,
    rps_warmup_s=0.3,
    rps_duration_s=2.0,
    rps_slices=2,
    tree_conversations=200,
    tree_workers=4,
    decision_calls=200,
    tokenizer_conversations=12,
)
FULL = Settings(
    False,
    small_requests=1000,
    conversations=100,
    turns=5,
    concurrency=32,
    rps_warmup_s=0.3,
    rps_duration_s=10.0,
    rps_slices=5,
    tree_conversations=200,
    tree_workers=4,
    decision_calls=1000,
    tokenizer_conversations=40,
)

"""The targets, reported and never asserted: each with its value, limit, whether it was
met and, when it was not, why (from the figures that explain it)."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import finite
from benchmarks.router_overhead.settings import (
    TARGET_COLD_MARGIN_MS,
    TARGET_DECISION_P50_US,
    TARGET_MULTI_TURN_ADDED_P50_MS,
    TARGET_RPS_RATIO,
)


def check(value: Any, op: str, limit: float) -> dict[str, Any]:
    met = None if not finite(value) else (value <= limit if op == "<=" else value >= limit)
    return {"value": value, "op": op, "limit": limit, "met": met}


def targets(fig: dict[str, Any]) -> dict[str, Any]:
    by_name = {s["name"]: s for s in fig["systems"]}
    ours = by_name["ours prompt_tree"]
    peer = by_name["sglang-router cache_aware"]
    tok, dec = fig["tokenizer"], fig["decision"]
    small_added = ours["added_paired_ms"]["small"]["p50"]
    out: dict[str, Any] = {}

    t = check(dec["select_hit_us"]["p50"], "<=", TARGET_DECISION_P50_US)
    t["about"] = "PromptTree.select p50 (us), 8K-token request, tokenizing excluded"
    if t["met"] is False:
        t["why"] = (
            f"select p50 {t['value']:.0f} us > {TARGET_DECISION_P50_US:.0f} us; the list -> "
            f"uint32 conversion alone is {dec['list_to_uint32_us']['p50']:.0f} us"
        )
    out["decision_p50_us"] = t

    # Latency targets use the paired p50 (median of per-request differences to the same
    # request sent direct moments before or after): the worker's own jitter (several ms on
    # an 8K chat) cancels in each pair, while a difference of two p50s moves with it.
    t = check(ours["added_paired_ms"]["multi_turn"]["p50"], "<=", TARGET_MULTI_TURN_ADDED_P50_MS)
    t["p50_difference"] = ours["added_ms"]["multi_turn"]["p50"]
    t["about"] = "ours prompt_tree: paired added latency p50 (ms), turn >= 2 of 8K chats"
    if t["met"] is False:
        t["why"] = (
            f"adds {t['value']:.2f} ms: warm encode {tok['cached_warm_ms']['p50']:.2f} ms "
            f"(template render {tok['render_ms']['p50']:.2f} ms, array -> list "
            f"{dec['uint32_to_list_us']['p50'] / 1e3:.2f} ms), select "
            f"{dec['select_hit_us']['p50'] / 1e3:.2f} ms, 2 x tree record "
            f"{2 * dec['record_8k_us']['p50'] / 1e3:.2f} ms; the proxy hop itself (small "
            f"chat) adds {small_added:.2f} ms"
        )
    out["multi_turn_added_p50_ms"] = t

    limit = tok["full_encode_ms"]["p50"] + TARGET_COLD_MARGIN_MS
    t = check(ours["added_paired_ms"]["cold_8k"]["p50"], "<=", limit)
    t["p50_difference"] = ours["added_ms"]["cold_8k"]["p50"]
    t["about"] = (
        "ours prompt_tree: paired added latency p50 (ms), cold 8K chat; limit = full encode "
        "p50 + 1 ms"
    )
    if t["met"] is False:
        t["why"] = (
            f"adds {t['value']:.2f} ms > {limit:.2f} ms: cached cold encode "
            f"{tok['cached_cold_ms']['p50']:.2f} ms, proxy hop {small_added:.2f} ms"
        )
    out["cold_8k_added_p50_ms"] = t

    if peer["available"] and ours["rps"] and peer["rps"] and peer["rps"]["rps"] > 0:
        ratio = ours["rps"]["rps"] / peer["rps"]["rps"]
        t = check(ratio, ">=", TARGET_RPS_RATIO)
        if t["met"] is False:
            t["why"] = (
                f"ours {ours['rps']['rps']:.0f} rps < {TARGET_RPS_RATIO} x sglang-router "
                f"{peer['rps']['rps']:.0f} rps"
            )
    else:
        t = {"value": None, "op": ">=", "limit": TARGET_RPS_RATIO, "met": None}
        t["why"] = "not measured: " + (
            peer["reason"] or "sglang-router completed no request in the rps window"
        )
    t["about"] = "max rps, ours prompt_tree / sglang-router cache_aware"
    out["rps_ratio"] = t
    return out

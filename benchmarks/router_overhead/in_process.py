"""The in-process figures (no HTTP): what our router's tokenizer and its routing decision
cost on an 8K-token chat."""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any, TypeVar

from rich.progress import Progress

from benchmarks.harness import step
from benchmarks.router_overhead.figures import p50_p99
from benchmarks.router_overhead.settings import Settings
from benchmarks.router_overhead.text import Conversation, make_conversation

A = TypeVar("A")
R = TypeVar("R")


def timed(call: Callable[[A], R], arg: A) -> tuple[float, R]:
    """(seconds, result) of `call(arg)`: for calls of milliseconds, where the extra
    function call (well under a microsecond) does not count."""
    t0 = time.perf_counter()
    result = call(arg)
    return time.perf_counter() - t0, result


def tokenizer_costs(
    tokenizer: Any, conversations: list[Conversation], progress: Progress
) -> dict[str, Any]:
    """Full encode of an 8K chat (what an engine does), and the router's own encode of a new
    chat (cold) and of its second turn (warm), as the router runs its CachedEncoder: with its
    encode thread started (new pieces encoded one by one, not in a batch), the chat's cached
    part first (`encode_chat_known`), then its new text (`complete`), ids left in an array."""
    from shared.token_cache import CachedEncoder

    task = progress.add_task("tokenizer: 8K chats", total=len(conversations) - 1)
    encoder = CachedEncoder(tokenizer)
    encoder.start_thread()
    encoder.encode_chat(conversations[0].turns[0])  # a running router knows the system prompt

    def routed(messages: list[dict[str, str]]) -> array:
        known = encoder.encode_chat_known(messages)
        return encoder.complete(known.ids, known.rest)

    full, cold, warm, render = [], [], [], []
    try:
        for conv in conversations[1:]:
            first, second = conv.turns[0], conv.turns[1]
            full.append(timed(tokenizer.encode_chat, first)[0])
            render.append(timed(tokenizer.render_chat, first)[0])
            seconds, ids = timed(routed, first)
            cold.append(seconds)
            warm.append(timed(routed, second)[0])
            if len(ids) != conv.tokens:
                raise RuntimeError(f"the router's encode gave {len(ids)} ids, not {conv.tokens}")
            step(progress, task)
    finally:
        encoder.close()
    return {
        "full_encode_ms": p50_p99(full, 1e3),
        "render_ms": p50_p99(render, 1e3),
        "cached_cold_ms": p50_p99(cold, 1e3),
        "cached_warm_ms": p50_p99(warm, 1e3),
        "conversations": len(full),
        "tokens_p50": statistics.median(c.tokens for c in conversations[1:]),
    }


def decision_time(
    tokenizer: Any, settings: Settings, progress: Progress
) -> tuple[dict[str, Any], list[Conversation]]:
    """PromptTree.select for an 8K-token request over trees holding many 8K chats."""
    from router.policies import CostModel, PromptTree, RouteRequest, Thresholds
    from router.trees import PromptTrees
    from router.workers import Worker, WorkerType
    from shared.token_cache import CachedEncoder

    n = settings.tree_conversations
    build = progress.add_task(f"decision: {n} chats into trees", total=n + 1)
    encoder = CachedEncoder(tokenizer)
    workers = [Worker(f"http://10.0.0.{i + 1}:30000") for i in range(settings.tree_workers)]
    trees = PromptTrees(page_size=16)
    policy = PromptTree(trees, Thresholds(), CostModel())
    kind = WorkerType.COLOCATED
    conversations: list[Conversation] = []
    hits: list[list[int]] = []
    for i in range(n):
        conv = make_conversation(tokenizer, 10_000 + i, turns=2, exact=False)
        conversations.append(conv)
        first = encoder.encode_chat(conv.turns[0])
        reply = conv.turns[1][-2]["content"]
        generated = tokenizer.encode(reply, add_special_tokens=False)
        trees.record(kind, workers[i % len(workers)].url, first + generated)  # after turn 1
        hits.append(encoder.encode_chat(conv.turns[1]))  # turn 2: a long prefix is held
        step(progress, build)
    misses = []  # new chats: only the shared system prompt is held
    for i in range(min(n, 20)):
        conv = make_conversation(tokenizer, 20_000 + i, turns=1, exact=False)
        misses.append(encoder.encode_chat(conv.turns[0]))
    step(progress, build)

    calls = settings.decision_calls
    timed = progress.add_task("decision: select() and record()", total=4)
    results: dict[str, Any] = {}
    # The router hands select() the uint32 array its token cache assembles (chats, text
    # prompts and token-id prompts alike): that is what is timed. The list variant (an
    # engine passing Python lists) shows what the conversion alone would cost.
    arrays = [array("I", t) for t in hits]
    for case, requests in (("hit", arrays), ("miss", [array("I", t) for t in misses])):
        samples = []
        reasons: dict[str, int] = {}
        for k in range(calls):
            request = RouteRequest(requests[k % len(requests)], "", None)
            t0 = time.perf_counter_ns()
            decision = policy.select(request, workers)
            samples.append(time.perf_counter_ns() - t0)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        results[f"select_{case}_us"] = p50_p99(samples, 1e-3)
        results[f"select_{case}_reasons"] = reasons
        step(progress, timed)
    to_array, to_list, with_list = [], [], []
    for k in range(calls):
        tokens, ids = hits[k % len(hits)], arrays[k % len(hits)]
        t0 = time.perf_counter_ns()
        array("I", tokens)
        t1 = time.perf_counter_ns()
        ids.tolist()
        t2 = time.perf_counter_ns()
        policy.select(RouteRequest(tokens, "", None), workers)
        t3 = time.perf_counter_ns()
        to_array.append(t1 - t0)
        to_list.append(t2 - t1)
        with_list.append(t3 - t2)
    results["list_to_uint32_us"] = p50_p99(to_array, 1e-3)
    results["uint32_to_list_us"] = p50_p99(to_list, 1e-3)
    results["select_hit_list_us"] = p50_p99(with_list, 1e-3)
    step(progress, timed)
    records = []  # the router's optimistic record on dispatch: an 8K path mostly held already
    for k in range(calls):
        i = k % len(hits)
        t0 = time.perf_counter_ns()
        trees.record(kind, workers[i % len(workers)].url, arrays[i])
        records.append(time.perf_counter_ns() - t0)
    results["record_8k_us"] = p50_p99(records, 1e-3)
    step(progress, timed)
    results.update(
        {
            "request_tokens_p50": statistics.median(len(t) for t in hits),
            "tree_conversations": n,
            "tree_workers": len(workers),
            "tree_pages": trees.size(kind),
            "calls": calls,
        }
    )
    return results, conversations

"""`python -m benchmarks.router_overhead --out DIR [--quick] [--before DIR]`: see the package
docstring."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import benchmarks.router_overhead as package
from benchmarks.harness import benchmark_main, progress_bar, run_async, shown_path, step
from benchmarks.load.bodies import CHAT, body, served_model
from benchmarks.peers import SGLANG_ROUTER, SMG, peer_status
from benchmarks.report.seeds import median_of
from benchmarks.router_overhead.figures import rps_ratios, scaling, system_figures, targets
from benchmarks.router_overhead.phases import (
    decision_time,
    latency_phase,
    rps_phase,
    tokenizer_costs,
)
from benchmarks.router_overhead.profile import profile_ours
from benchmarks.router_overhead.report import write
from benchmarks.router_overhead.settings import (
    FULL,
    NAME,
    QUICK,
    RPS_MAX_TOKENS,
    SEED,
    SMALL_MAX_TOKENS,
    SYSTEM_PROMPT,
    make_conversation,
    small_prompts,
)
from benchmarks.router_overhead.systems import (
    WORKER_ARGS,
    WORKERS,
    check_before,
    cpu_sets,
    make_systems,
    start_systems,
    worker_launches,
)
from localrun.processes import Server, start_all, stop_all


def run(out_dir: Path, quick: bool, before: Path | None = None) -> dict[str, Any]:
    if before is not None:
        before = before.resolve()
        if not (before / "router" / "__main__.py").is_file():
            raise SystemExit(f"--before {before}: no router/__main__.py there")
        check_before(before)
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    from connector.model_files import ensure_hf_model
    from shared.tokenizer import ChatTokenizer

    model_dir = ensure_hf_model()
    peers = {p: peer_status(p) for p in (SGLANG_ROUTER, SMG)}
    with tempfile.TemporaryDirectory(prefix="router_overhead-") as tmp, progress_bar() as progress:
        log_dir = Path(tmp)
        launches = worker_launches(model_dir, log_dir)
        systems = make_systems([w.url for w in launches], log_dir, peers, before, not quick)
        workers: list[Server] = []
        try:
            boot = progress.add_task(f"start {WORKERS} workers and the routers", total=2)
            workers = start_all(launches, 120)
            step(progress, boot)
            # Only single encodes in this process before the routers are forked: the
            # tokenizers library warns when a process that used its thread pool forks.
            tokenizer = ChatTokenizer(model_dir)
            model = served_model(workers[0].url)

            def chat(messages: list[dict[str, str]], max_tokens: int = SMALL_MAX_TOKENS) -> bytes:
                return body(CHAT, messages, max_tokens, model=model)

            start_systems(systems, chat(small_prompts(1)[0], 1))
            step(progress, boot)

            build = progress.add_task("build workloads", total=settings.conversations + 2)
            small = [chat(m) for m in small_prompts(settings.small_requests)]
            rps_payloads = [chat(m, RPS_MAX_TOKENS) for m in small_prompts(512)]
            step(progress, build)
            conversations = []
            for i in range(settings.conversations):
                conversations.append(make_conversation(tokenizer, i, settings.turns))
                step(progress, build)
            warmup = small[:5] + [chat(m) for m in make_conversation(tokenizer, 999_999, 2).turns]
            step(progress, build)

            run_async(
                latency_phase(systems, workers, small, conversations, warmup, progress, model)
            )
            run_async(rps_phase(systems, rps_payloads, settings, progress))
            profiled = run_async(profile_ours(systems, rps_payloads, settings, log_dir))
        finally:
            stop_all([s.server for s in systems if s.server is not None] + workers)
        chats = conversations[: settings.tokenizer_conversations]
        extra = settings.tokenizer_conversations + 1 - len(chats)  # the first: the warm-up
        chats += [make_conversation(tokenizer, 50_000 + i, 2) for i in range(extra)]
        tok = tokenizer_costs(tokenizer, chats, progress)
        decision = decision_time(tokenizer, settings, progress)

    baseline = systems[0]

    def prompt_tokens(workload: str) -> list[int]:
        return [r.prompt_tokens for r in baseline.records.get(workload, []) if r.ok]

    peer = [s for s in systems if s.router == SGLANG_ROUTER]
    figures: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "seed": SEED,
        "peer_available": all(s.available for s in peer),
        "peer": {
            "package": SGLANG_ROUTER,
            "version": peers[SGLANG_ROUTER].version,
            "importable": peers[SGLANG_ROUTER].importable,
            "reason": next((s.reason for s in peer if s.reason), None),
        },
        "peers": {n: {"version": p.version, "importable": p.importable} for n, p in peers.items()},
        "core_counts": [len(cpus) for cpus in cpu_sets()],
        "systems": [system_figures(s, baseline) for s in systems],
        "tokenizer": tok,
        "decision": decision,
        "profile": profiled,
        "workloads": {
            "small_prompt_tokens_p50": median_of(prompt_tokens("small")),
            "cold_8k_prompt_tokens_p50": median_of(c.tokens for c in conversations),
            "multi_turn_prompt_tokens_p50": median_of(prompt_tokens("multi_turn")),
            "system_prompt_tokens": len(tokenizer.encode(SYSTEM_PROMPT, False)),
            "conversations": settings.conversations,
            "turns_per_conversation": settings.turns,
            "max_tokens": SMALL_MAX_TOKENS,
        },
        "config": {
            "settings": asdict(settings),
            "workers": WORKERS,
            "worker_args": " ".join(WORKER_ARGS),
            "model_dir": shown_path(model_dir),
        },
    }
    figures["rps_ratio"] = rps_ratios(figures)
    figures["scaling"] = scaling(figures)
    figures["targets"] = targets(figures)
    figures["elapsed_s"] = time.perf_counter() - started
    write(out_dir, figures, settings)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    """The shared `--out DIR [--quick]`, and `--before DIR`."""
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also run the router from DIR (a worktree of an earlier commit, e.g. `git "
        "worktree add ../before HEAD~1`, installed in DIR/.venv) beside this one: a "
        "before/after in the same run",
    )
    quick = "fewer requests, shorter rps runs"
    return benchmark_main(argv, NAME, package.__doc__, run, quick, extra=extra)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m benchmarks.router_overhead --out DIR [--quick]`: see the package docstring."""

from __future__ import annotations

import argparse
import statistics
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
from benchmarks.router_overhead.figures import rps_ratios, scaling, system_figures
from benchmarks.router_overhead.in_process import decision_time, tokenizer_costs
from benchmarks.router_overhead.phases import latency_phase, rps_phase
from benchmarks.router_overhead.plots import plot
from benchmarks.router_overhead.report import write
from benchmarks.router_overhead.settings import (
    FULL,
    NAME,
    QUICK,
    RPS_MAX_TOKENS,
    SEED,
    SMALL_MAX_TOKENS,
)
from benchmarks.router_overhead.systems import (
    WORKER_ARGS,
    WORKERS,
    cpu_sets,
    make_systems,
    start_systems,
    stop_systems,
    worker_launches,
)
from benchmarks.router_overhead.targets import targets
from benchmarks.router_overhead.text import (
    SYSTEM_PROMPT,
    make_conversation,
    small_prompts,
)
from localrun.processes import Server, start_all


def run(out_dir: Path, quick: bool, before: Path | None = None) -> dict[str, Any]:
    if before is not None:
        before = before.resolve()
        if not (before / "router" / "__main__.py").is_file():
            raise SystemExit(f"--before {before}: no router/__main__.py there")
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    from connector.model_files import ensure_hf_model
    from shared.tokenizer import ChatTokenizer

    model_dir = ensure_hf_model()
    peers = {p: peer_status(p) for p in (SGLANG_ROUTER, SMG)}
    peer = peers[SGLANG_ROUTER]
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
            probe = body(CHAT, small_prompts(1)[0], 1, model=model)
            start_systems(systems, probe)
            step(progress, boot)

            build = progress.add_task("build workloads", total=settings.conversations + 2)
            small = [
                body(CHAT, m, SMALL_MAX_TOKENS, model=model)
                for m in small_prompts(settings.small_requests)
            ]
            rps_payloads = [body(CHAT, m, RPS_MAX_TOKENS, model=model) for m in small_prompts(512)]
            step(progress, build)
            conversations = []
            for i in range(settings.conversations):
                conversations.append(make_conversation(tokenizer, i, settings.turns))
                step(progress, build)
            warm_conv = make_conversation(tokenizer, 999_999, 2)
            warmup = (
                small[:5],
                [body(CHAT, m, SMALL_MAX_TOKENS, model=model) for m in warm_conv.turns],
            )
            step(progress, build)

            run_async(
                latency_phase(
                    systems, workers, small, conversations, warmup, settings, progress, model
                )
            )
            run_async(rps_phase(systems, rps_payloads, settings, progress))
        finally:
            stop_systems(systems, workers)
        tokenizer_conversations = conversations[: settings.tokenizer_conversations]
        extra = settings.tokenizer_conversations + 1 - len(tokenizer_conversations)
        tokenizer_conversations += [
            make_conversation(tokenizer, 50_000 + i, 2) for i in range(max(extra, 0))
        ]
        tok = tokenizer_costs(tokenizer, tokenizer_conversations, progress)
        decision, _ = decision_time(tokenizer, settings, progress)

    baseline = systems[0]
    figures: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "seed": SEED,
        "peer_available": all(
            s.available for s in systems if s.kind == "peer" and s.router == SGLANG_ROUTER
        ),
        "peer": {
            "package": SGLANG_ROUTER,
            "version": peer.version,
            "importable": peer.importable,
            "reason": next(
                (s.reason for s in systems if s.router == SGLANG_ROUTER and s.reason), None
            ),
        },
        "peers": {
            name: {"version": status.version, "importable": status.importable}
            for name, status in peers.items()
        },
        "core_counts": [len(cpus) for cpus in cpu_sets()],
        "systems": [system_figures(s, baseline) for s in systems],
        "tokenizer": tok,
        "decision": decision,
        "workloads": {
            "small_prompt_tokens_p50": _median(baseline.prompt_tokens.get("small")),
            "cold_8k_prompt_tokens_p50": statistics.median(c.tokens for c in conversations),
            "multi_turn_prompt_tokens_p50": _median(baseline.prompt_tokens.get("multi_turn")),
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
    plot(out_dir / f"{NAME}.png", figures)
    return figures


def _median(values: Sequence[float] | None) -> float | None:
    return statistics.median(values) if values else None


def main(argv: Sequence[str] | None = None) -> int:
    """The shared `--out DIR [--quick]`, and `--before DIR`."""
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument(
        "--before",
        type=Path,
        default=None,
        help="also run the router from DIR (a worktree of an earlier commit, e.g. `git "
        "worktree add ../before HEAD~1`) beside this one: a before/after in the same run",
    )
    quick = "fewer requests, shorter rps runs"
    return benchmark_main(argv, NAME, package.__doc__, run, quick, extra=extra)


if __name__ == "__main__":
    sys.exit(main())

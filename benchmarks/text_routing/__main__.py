"""`python -m benchmarks.text_routing [--quick] [--policy P] [--tokenizer-dir DIR] [--out DIR]`:
the run, then results.json and README.md (the table of issue 37, a row per document and route).
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import benchmarks.text_routing as package
from benchmarks.harness import (
    REPO_ROOT,
    progress_bar,
    shown_command,
    shown_path,
    step,
    stop_children_on_terminate,
)
from benchmarks.load.bodies import served_model
from benchmarks.multiturn.cluster import RouterSpec, start_router
from benchmarks.peers import OURS
from benchmarks.report.page import machine_facts, write_results
from benchmarks.report.table import markdown_table
from benchmarks.text_routing.cells import (
    REQUESTS,
    ROUTES,
    TOKEN_POLICIES,
    Cell,
    run_cell,
    text_probe,
)
from benchmarks.text_routing.documents import DOCUMENTS, SEED, prompt
from localrun.cluster import Cluster, ClusterSpec

NAME = "text_routing"
RESULTS = REPO_ROOT / "benchmarks" / "results" / NAME
WORKERS = 2
# Tokens of each document (of the tokenizer in use): about issue 37's sizes.
FULL_TOKENS = {
    "chinese": 14_700,
    "japanese": 12_000,
    "numbers": 17_250,
    "synthetic_words": 3_700,
    "json_tools": 10_700,
    "python_code": 6_700,
    "english_prose": 4_700,
    "mixed": 8_000,
}
# Quick: one document the router misses today and one it predicts, small.
QUICK_TOKENS = {"chinese": 1_500, "english_prose": 1_000}


def common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """How many leading ids every sequence shares."""
    columns = zip(*sequences, strict=False)
    return next((i for i, c in enumerate(columns) if len(set(c)) > 1), min(map(len, sequences)))


def default_out(policy: str, quick: bool, tokenizer_dir: Path | None) -> Path:
    """benchmarks/results/text_routing for the headline run (prompt_tree, the tiny model's
    tokenizer, full); a subfolder for any other."""
    parts = [] if policy == "prompt_tree" else [policy]
    if tokenizer_dir is not None:
        parts.append("tokenizer-" + tokenizer_dir.resolve().name)
    if quick:
        parts.append("quick")
    return RESULTS / "-".join(parts) if parts else RESULTS


def run(
    out_dir: Path, quick: bool, policy: str, tokenizer_dir: Path | None, command: str
) -> dict[str, Any]:
    started = time.perf_counter()
    from connector.model_files import ensure_hf_model
    from shared.tokenizer import ChatTokenizer

    model_dir = tokenizer_dir.resolve() if tokenizer_dir is not None else ensure_hf_model()
    sizes = QUICK_TOKENS if quick else FULL_TOKENS
    tokenizer = ChatTokenizer(model_dir)  # single encodes only, before any server starts
    texts = {key: DOCUMENTS[key].make(tokenizer, tokens) for key, tokens in sizes.items()}
    prompts = {
        key: [prompt(text, DOCUMENTS[key].language, i) for i in range(REQUESTS)]
        for key, text in texts.items()
    }
    documents: list[dict[str, Any]] = [
        {
            "key": key,
            "title": DOCUMENTS[key].title,
            "source": DOCUMENTS[key].source,
            "tokens": len(tokenizer.encode(text, False)),
            # what the three prompts share (the document and the questions' common start):
            # no worker can report more of a later prompt as cached
            "shared_tokens": common_prefix([tokenizer.encode(p, False) for p in prompts[key]]),
            "characters": len(text),
        }
        for key, text in texts.items()
    ]
    cells: list[Cell] = []
    spec = ClusterSpec(NAME, colocated=WORKERS)
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp, progress_bar() as progress:
        log_dir = Path(tmp)
        cluster = Cluster.create(spec, model_dir, log_dir, None)
        boot = progress.add_task(f"start {WORKERS} sim workers", total=1)
        try:
            workers = cluster.start()
            step(progress, boot)
            model = served_model(workers[0])
            total = len(texts) * len(ROUTES) * REQUESTS
            task = progress.add_task(f"requests via {policy}", total=total)
            tick = functools.partial(step, progress, task)
            for doc in documents:
                key = doc["key"]
                for route in ROUTES:
                    progress.update(task, description=f"{key} {route}")
                    cluster.flush()
                    system, tag = RouterSpec(OURS, policy), f"router-{policy}-{key}-{route}"
                    router = start_router(
                        system, cluster, log_dir, model, probe=text_probe, tag=tag
                    )
                    cell = Cell(key, doc["title"], route, doc["tokens"], doc["shared_tokens"])
                    try:
                        learns = policy in TOKEN_POLICIES
                        run_cell(router.url, workers, model, cell, prompts[key], learns, tick)
                    finally:
                        router.stop()
                    cells.append(cell)
        finally:
            cluster.stop()

    figures: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "command": command,
        "date": datetime.now(UTC).date().isoformat(),
        "policy": policy,
        "tokenizer": shown_path(model_dir),
        "seed": SEED,
        "workers": WORKERS,
        "requests_per_cell": REQUESTS,
        "routes": list(ROUTES),
        "documents": documents,
        "cells": [c.as_dict() for c in cells],
        "predicted_hits": sum(c.predicted_hits for c in cells),
        "rows_meeting_target": sum(c.target_met for c in cells),
        "rows": len(cells),
        "machine": machine_facts(),
        "elapsed_s": time.perf_counter() - started,
    }
    title = "Text prompts: does the router predict the cache hit? (issue 37)"
    machine = figures["machine"]
    write_results(out_dir, "results", figures, None, title, [], machine, page(figures), "README.md")
    return figures


def n(value: float | int) -> str:
    return f"{int(value):,}"


def table_rows(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for cell in cells:
        requests = cell["requests"]
        hits = [r for r in requests if r["predicted_hit"]]
        predicted_vs = "; ".join(
            f"#{r['request']}: "
            + ("n/a" if r["predicted_cached_tokens"] is None else n(r["predicted_cached_tokens"]))
            + f" vs {n(r['cached_tokens'])}"
            for r in hits
        )
        tokens = [r["prompt_tokens"] for r in requests]
        low, high = min(tokens), max(tokens)
        rows.append(
            {
                "document (sent as a text prompt)": cell["title"],
                "route": f"`{cell['route']}`",
                "prompt tokens": n(low) if low == high else f"{n(low)}-{n(high)}",
                "cached tokens the worker reported": ", ".join(
                    n(r["cached_tokens"]) for r in requests
                ),
                "router's predicted hits": f"{len(hits)} of {len(requests)}",
                "predicted vs reported cached (hits)": predicted_vs or "—",
                "worker per request": ", ".join(str(r["worker"] or "?") for r in requests),
                "decision per request": ", ".join(str(r["reason"] or "?") for r in requests),
                "target (2 of 3) met": cell["target_met"],
            }
        )
    return rows


def page(figures: dict[str, Any]) -> list[str]:
    cells, machine = figures["cells"], figures["machine"]
    dirty = " (with local changes)" if machine.get("git_dirty") else ""
    documents = [
        {
            "document": d["title"],
            "tokens (document alone)": n(d["tokens"]),
            "characters": n(d["characters"]),
            "source": d["source"],
        }
        for d in figures["documents"]
    ]
    return [
        f"Measured at commit `{machine.get('git_commit', '?')}{dirty}` on {figures['date']} "
        f"with `{figures['command']}` ({figures['mode']} run, {figures['elapsed_s']:.0f} s): "
        f"two sim workers behind `python -m router --policy {figures['policy']}`, tokenizer "
        f"`{figures['tokenizer']}`. What it runs and why, and what each column is: "
        "`docs/benchmarks/text-routing.md`.",
        "",
        f"**{figures['rows_meeting_target']} of {len(cells)} rows meet the target** (2 of 3 "
        "predicted: the first request of a cold router cannot be).",
        "",
        markdown_table(table_rows(cells)),
        "",
        "## Documents",
        "",
        markdown_table(documents),
        "",
        "How each text is made (generated ones seeded with "
        f'`"{figures["seed"]}:<document>"`; no data file ships): '
        "`benchmarks/text_routing/README.md`.",
        "",
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = (package.__doc__ or NAME).splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text_routing", description=doc)
    parser.add_argument(
        "--out",
        type=Path,
        help="directory for results.json and README.md (default: benchmarks/results/"
        "text_routing, or a subfolder of it named after --policy, --tokenizer-dir, --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="two small documents (Chinese, English): ~30 s"
    )
    parser.add_argument(
        "--policy", default="prompt_tree", help="the router's --policy (cache_aware to compare)"
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="a directory with tokenizer.json for the workers (--model-path) and the router "
        "(--tokenizer-path); default: the tiny model's (connector.model_files)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tokenizer_dir is not None and not (args.tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer-dir {args.tokenizer_dir}: no tokenizer.json there")
    stop_children_on_terminate()
    out = args.out or default_out(args.policy, args.quick, args.tokenizer_dir)
    command = shown_command("python -m benchmarks.text_routing", (argv or sys.argv[1:]))
    figures = run(out, args.quick, args.policy, args.tokenizer_dir, command)
    print(
        f"{NAME}: {figures['mode']} run, {figures['elapsed_s']:.1f} s -> {shown_path(out)}: "
        f"{figures['rows_meeting_target']} of {figures['rows']} rows at 2 of 3 predicted"
    )
    print((out / "README.md").read_text().split("\n## Documents")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

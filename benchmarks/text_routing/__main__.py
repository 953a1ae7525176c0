"""`python -m benchmarks.text_routing [--quick] [--policy P] [--tokenizer-dir DIR] [--out DIR]`:
see the package docstring."""

from __future__ import annotations

import argparse
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
from benchmarks.report.page import machine_facts
from benchmarks.text_routing.cells import (
    REQUESTS,
    ROUTES,
    WORKERS,
    Cell,
    make_cluster,
    run_cell,
    start_router,
)
from benchmarks.text_routing.documents import DOCUMENTS, SEED, prompt
from benchmarks.text_routing.report import write

NAME = "text_routing"
RESULTS = REPO_ROOT / "benchmarks" / "results" / NAME

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
    n = 0
    for column in zip(*sequences, strict=False):
        if any(v != column[0] for v in column):
            break
        n += 1
    return n


def default_out(policy: str, quick: bool, tokenizer_dir: Path | None) -> Path:
    """benchmarks/results/text_routing for the headline run (prompt_tree, the tiny model's
    tokenizer, full); a subfolder for any other."""
    parts = []
    if policy != "prompt_tree":
        parts.append(policy)
    if tokenizer_dir is not None:
        parts.append("tokenizer-" + tokenizer_dir.resolve().name)
    if quick:
        parts.append("quick")
    return RESULTS / "-".join(parts) if parts else RESULTS


def run(
    out_dir: Path,
    quick: bool,
    policy: str,
    tokenizer_dir: Path | None,
    command: str,
) -> dict[str, Any]:
    started = time.perf_counter()
    from connector.model_files import ensure_hf_model
    from shared.tokenizer import ChatTokenizer

    model_dir = tokenizer_dir.resolve() if tokenizer_dir is not None else ensure_hf_model()
    sizes = QUICK_TOKENS if quick else FULL_TOKENS
    # Single encodes only, before any server process is started.
    tokenizer = ChatTokenizer(model_dir)
    texts = {key: DOCUMENTS[key].make(tokenizer, tokens) for key, tokens in sizes.items()}
    documents: list[dict[str, Any]] = [
        {
            "key": key,
            "title": DOCUMENTS[key].title,
            "source": DOCUMENTS[key].source,
            "tokens": len(tokenizer.encode(text, False)),
            # what the three prompts share (the document and the questions' common start):
            # no worker can report more of a later prompt as cached
            "shared_tokens": common_prefix(
                [
                    tokenizer.encode(prompt(text, DOCUMENTS[key].language, i), False)
                    for i in range(REQUESTS)
                ]
            ),
            "characters": len(text),
        }
        for key, text in texts.items()
    ]
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="text_routing-") as tmp, progress_bar() as progress:
        log_dir = Path(tmp)
        cluster = make_cluster(model_dir, log_dir)
        boot = progress.add_task(f"start {WORKERS} sim workers", total=1)
        try:
            cluster.start()
            step(progress, boot)
            workers = [w.url for w in cluster.workers]
            model = served_model(workers[0])
            total = len(texts) * len(ROUTES) * REQUESTS
            task = progress.add_task(f"requests via {policy}", total=total)
            for doc in documents:
                key = doc["key"]
                for route in ROUTES:
                    progress.update(task, description=f"{key} {route}")
                    cluster.flush()
                    router = start_router(policy, cluster, log_dir, f"{policy}-{key}-{route}")
                    try:
                        cell = Cell(key, doc["title"], route, doc["tokens"], doc["shared_tokens"])
                        document = DOCUMENTS[key]
                        run_cell(
                            router,
                            workers,
                            model,
                            cell,
                            texts[key],
                            document.language,
                            policy,
                            lambda: step(progress, task),
                        )
                    finally:
                        router.stop()
                    cells.append(cell)
        finally:
            cluster.stop()

    machine = machine_facts()
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
        "machine": machine,
        "elapsed_s": time.perf_counter() - started,
    }
    write(out_dir, figures)
    return figures


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = (package.__doc__ or NAME).splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.text_routing", description=doc)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for results.json and README.md (default: benchmarks/results/"
        "text_routing, or a subfolder of it named after --policy, --tokenizer-dir, --quick)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="two small documents (Chinese, English): ~30 s"
    )
    parser.add_argument(
        "--policy",
        default="prompt_tree",
        help="the router's --policy (prompt_tree; cache_aware to compare)",
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
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
    page = (out / "README.md").read_text()
    print(page.split("\n## Columns")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""results.json and README.md: the table of issue 37, one row per (document, route)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report.page import write_results
from benchmarks.report.table import markdown_table


def n(value: float | int) -> str:
    return f"{int(value):,}"


def spread(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return n(low) if low == high else f"{n(low)}-{n(high)}"


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
        rows.append(
            {
                "document (sent as a text prompt)": cell["title"],
                "route": f"`{cell['route']}`",
                "prompt tokens": spread([r["prompt_tokens"] for r in requests]),
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


def write(out_dir: Path, figures: dict[str, Any]) -> tuple[Path, Path]:
    """results.json and README.md, replacing what `out_dir` held under those names."""
    title = "Text prompts: does the router predict the cache hit? (issue 37)"
    return write_results(
        out_dir, "results", figures, None, title, [], figures["machine"], body(figures), "README.md"
    )


def body(figures: dict[str, Any]) -> list[str]:
    cells = figures["cells"]
    machine = figures["machine"]
    met = sum(c["target_met"] for c in cells)
    commit = machine.get("git_commit", "?") + (
        " (with local changes)" if machine.get("git_dirty") else ""
    )
    return [
        f"Measured at commit `{commit}` on {figures['date']} with `{figures['command']}` "
        f"({figures['mode']} run, {figures['elapsed_s']:.0f} s).",
        "",
        f"Two sim workers, `python -m router --policy {figures['policy']}` in front of them, "
        f"tokenizer `{figures['tokenizer']}`. Each document is sent three times as a text "
        "prompt, each time with a different question after it, one request at a time; each "
        "(document, route) starts with flushed worker caches and a new router process. A "
        "request is a predicted hit when the router's `sgl_router_cache_hits_total` grew "
        "while it was routed (or the decision's reason is `cache_hit`).",
        "",
        f"**{met} of {len(cells)} rows meet the target** (2 of 3 predicted: the first "
        "request of a cold router cannot be).",
        "",
        markdown_table(table_rows(cells)),
        "",
        "## Columns",
        "",
        "- prompt tokens: as the worker reported them (the three questions differ in length).",
        "- cached tokens the worker reported: `usage.prompt_tokens_details.cached_tokens` "
        "(`/v1/completions`) or `meta_info.cached_tokens` (`/generate`), per request.",
        "- predicted vs reported cached: for each predicted hit, the router's "
        "`memserve_router_predicted_cached_tokens_total` growth against the worker's report.",
        "- worker per request: which of the two workers served it "
        "(`sgl_router_processed_requests_total`); decision: the reason counted in "
        "`sgl_router_load_balancing_events_total`.",
        "",
        "## Documents",
        "",
        markdown_table(
            [
                {
                    "document": d["title"],
                    "tokens (document alone)": n(d["tokens"]),
                    "characters": n(d["characters"]),
                    "source": d["source"],
                }
                for d in figures["documents"]
            ]
        ),
        "",
        "The generated texts come from `benchmarks/text_routing/documents.py` (word lists "
        f'written for it, `random.Random` seeded with `"{figures["seed"]}:<document>"`); the '
        "repository's own files are read as they are at the commit above. No data file ships; "
        "see `benchmarks/text_routing/README.md`.",
        "",
    ]

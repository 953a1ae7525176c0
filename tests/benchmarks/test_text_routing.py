"""The text-routing benchmark (issue 37) runs end to end in quick mode and writes its table.

The hit counts are not asserted (they are what the benchmark measures); what holds whatever
the router predicts is: each (document, route) starts cold, so its first request is no
predicted hit and finds nothing cached, and its later ones find the document cached.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.text_routing.__main__ import QUICK_TOKENS
from benchmarks.text_routing.cells import REQUESTS, ROUTES
from benchmarks.text_routing.documents import DOCUMENTS, prompt
from tests.benchmarks.runs import REPO_ROOT, benchmark, read_json

REQUEST_FIELDS = {
    "request",
    "prompt_tokens",
    "cached_tokens",
    "predicted_hit",
    "cache_hits_delta",
    "reason",
    "worker",
    "predicted_cached_tokens",
    "router_reported_cached_tokens",
    "latency_s",
}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("text_routing")
    done = benchmark("text_routing", out, "--quick", timeout=120)
    assert done.returncode == 0, f"benchmark failed:\n{done.stdout}\n{done.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def figures(out_dir: Path) -> dict[str, Any]:
    return read_json(out_dir / "results.json")


def test_files_are_written(out_dir: Path) -> None:
    for name in ("results.json", "README.md"):
        path = out_dir / name
        assert path.is_file() and path.stat().st_size > 0, path


def test_one_cell_per_document_and_route(figures: dict[str, Any]) -> None:
    assert figures["mode"] == "quick"
    assert figures["policy"] == "prompt_tree"
    assert figures["workers"] == 2
    assert [d["key"] for d in figures["documents"]] == list(QUICK_TOKENS)
    cells = [(c["document"], c["route"]) for c in figures["cells"]]
    assert cells == [(key, route) for key in QUICK_TOKENS for route in ROUTES]
    assert figures["rows"] == len(cells)
    for d in figures["documents"]:
        assert d["tokens"] >= QUICK_TOKENS[d["key"]], d
        assert d["source"] == DOCUMENTS[d["key"]].source
    for key in ("git_commit", "timestamp_utc"):
        assert figures["machine"].get(key), key
    assert figures["date"] and figures["elapsed_s"] > 0


def test_every_request_is_recorded(figures: dict[str, Any]) -> None:
    for cell in figures["cells"]:
        assert isinstance(cell["predicted_hits"], int)
        assert isinstance(cell["target_met"], bool)
        requests = cell["requests"]
        assert [r["request"] for r in requests] == list(range(1, REQUESTS + 1))
        for r in requests:
            assert set(r) == REQUEST_FIELDS, r
            assert r["prompt_tokens"] > cell["document_tokens"], (cell["route"], r)
            assert isinstance(r["predicted_hit"], bool)
            assert r["worker"] in (1, 2), r  # the router's per-worker count grew by one
            assert isinstance(r["reason"], str), r
            assert r["predicted_cached_tokens"] is not None  # prompt_tree predicts tokens
            # the router learned what the worker reported
            assert r["router_reported_cached_tokens"] == r["cached_tokens"], r
        assert cell["predicted_hits"] == sum(r["predicted_hit"] for r in requests)


def test_a_cold_start_then_cached(figures: dict[str, Any]) -> None:
    """Flushed workers and a new router per cell: nothing predicted or cached for the first
    request; the document is cached for the second and third, never more than the prompts
    share (the document and the start of the questions)."""
    for cell in figures["cells"]:
        first, *later = cell["requests"]
        assert first["predicted_hit"] is False, cell
        assert first["cached_tokens"] == 0, cell
        for r in later:
            assert r["cached_tokens"] > 0, (cell["document"], cell["route"], r)
            assert r["cached_tokens"] <= cell["shared_tokens"], r


def test_the_page_has_the_table_and_no_machine_paths(
    out_dir: Path, figures: dict[str, Any]
) -> None:
    page = (out_dir / "README.md").read_text()
    assert "| document (sent as a text prompt) | route | prompt tokens |" in page
    assert "router's predicted hits" in page
    assert f"`{figures['machine']['git_commit']}" in page
    assert figures["date"] in page
    for cell in figures["cells"]:
        assert f"{cell['predicted_hits']} of {REQUESTS}" in page
    for text in (page, (out_dir / "results.json").read_text()):
        for path in (str(REPO_ROOT), str(out_dir), str(Path.home())):
            assert path not in text


def test_documents_are_deterministic_and_sized(model_dir: Path) -> None:
    from shared.tokenizer import ChatTokenizer

    tokenizer = ChatTokenizer(model_dir)
    for key, document in DOCUMENTS.items():
        text = document.make(tokenizer, 600)
        assert text == document.make(tokenizer, 600), key
        tokens = len(tokenizer.encode(text, False))
        assert 600 <= tokens < 1200, (key, tokens)
        asked = [prompt(text, document.language, i) for i in range(REQUESTS)]
        assert len(set(asked)) == REQUESTS and all(a.startswith(text) for a in asked)
    chinese = DOCUMENTS["chinese"].make(tokenizer, 600)
    assert " " not in chinese and "。" in chinese
    assert "は" in DOCUMENTS["japanese"].make(tokenizer, 600)
    assert "=" in DOCUMENTS["mixed"].make(tokenizer, 600)

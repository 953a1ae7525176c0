"""The metric tables of the docs name exactly the metrics the code exports: every metric of
the router (as `python -m router` builds it, with KV events and replicas) and of the CPU
worker is explained, and no page names one that does not exist."""

from __future__ import annotations

import re

from router.metrics import KV_EVENT_COUNTERS
from tests.deploy.manifests import router_metric_names
from tests.procs import ROOT

DOCS = ROOT / "docs"
SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def family(name: str) -> str:
    """A series name as its metric family: a counter's `_total`, a histogram's `_bucket` ...
    dropped."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def documented(page: str, pattern: str) -> set[str]:
    """Metric names in the first column of a page's tables."""
    rows = re.findall(r"^\| `([^`]+)` \|", (DOCS / page).read_text(), re.M)
    return {family(r) for r in rows if re.match(pattern, r)}


def test_the_router_metrics_page_names_every_router_metric_and_no_other() -> None:
    code = {family(n) for n in router_metric_names()}
    # the KV-event counters exist per feed: --kv-events-bind adds unknown_topics
    code |= {f"memserve_router_kv_event_{what}" for what in KV_EVENT_COUNTERS}
    docs = documented("router/metrics.md", r"(sgl_router_|memserve_router_)")
    assert docs - code == set(), f"documented, not exported: {sorted(docs - code)}"
    assert code - docs == set(), f"exported, not documented: {sorted(code - docs)}"


def test_the_worker_metrics_page_names_every_worker_metric_and_no_other() -> None:
    source = (ROOT / "connector" / "worker" / "server.py").read_text()
    code = set(re.findall(r"\"((?:sglang|memserve):\w+)\"", source))
    docs = documented("worker/metrics.md", r"(sglang:|memserve:)")
    assert docs - code == set(), f"documented, not exported: {sorted(docs - code)}"
    assert code - docs == set(), f"exported, not documented: {sorted(code - docs)}"


def test_every_metric_named_anywhere_in_the_docs_exists() -> None:
    """Prose and queries too: any `sgl_router_*`, `memserve_router_*`, `sglang:*` or
    `memserve:*` name on any page."""
    router = {family(n) for n in router_metric_names()}
    router |= {f"memserve_router_kv_event_{what}" for what in KV_EVENT_COUNTERS}
    source = (ROOT / "connector" / "worker" / "server.py").read_text()
    worker = set(re.findall(r"\"((?:sglang|memserve):\w+)\"", source))
    unknown = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for name in re.findall(r"(?<![\w:.])((?:sgl_router_|memserve_router_)\w+)", text):
            if family(name) not in router and not name.endswith("_"):
                unknown.append(f"{page.relative_to(ROOT)}: {name}")
        for name in re.findall(r"(?<![\w:/])((?:sglang|memserve):[a-z][a-z0-9_]*)", text):
            if family(name) not in worker and not name.endswith("_"):
                unknown.append(f"{page.relative_to(ROOT)}: {name}")
    assert not unknown, unknown

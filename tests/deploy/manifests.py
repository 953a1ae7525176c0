"""What the deploy tests read: deploy/'s files, the router's own argument parser, route table
and metrics, and (when installed) SGLang's flags, so a file that names something the code
does not have fails here instead of at an operator's first start."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from router.__main__ import build_parser, build_router, pd_workers, replica_config
from router.management import Management
from router.replicas import ReplicaMetrics
from router.server import OPEN_ROUTES, Router
from tests.procs import ROOT

DEPLOY = ROOT / "deploy"
# Metric names as PromQL uses them: the router's, ours, and SGLang's (colon-separated).
METRIC = re.compile(r"(?<![\w:])((?:sgl_router_|memserve_router_|memserve:|sglang:)[\w:]*)")


def load_yaml(path: Path) -> list[Any]:
    """Every document of a YAML file (PyYAML's safe loader: anchors and merge keys)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def load_one(path: Path) -> Any:
    (doc,) = load_yaml(path)
    return doc


def flags(argv: Iterable[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def value(argv: list[str], flag: str) -> str:
    """The value after `flag` (AssertionError when missing)."""
    assert flag in argv, f"{flag} missing from {argv}"
    return argv[argv.index(flag) + 1]


def values(argv: list[str], flag: str) -> list[list[str]]:
    """Every occurrence's values (up to the next flag): `--prefill URL PORT` twice -> 2 lists."""
    out = []
    for i, a in enumerate(argv):
        if a == flag:
            rest = argv[i + 1 :]
            end = next((j for j, b in enumerate(rest) if b.startswith("--")), len(rest))
            out.append(rest[:end])
    return out


def router_args(argv: list[str]) -> argparse.Namespace:
    """The router's parser on a deploy file's command line: every flag must be one of its
    option strings exactly (argparse would accept an abbreviation), and what the router checks
    before starting (PD pairs, replica settings) must pass."""
    parser = build_parser()
    known = set(parser._option_string_actions)
    unknown = [f for f in flags(argv) if f not in known]
    assert not unknown, f"the router has no {unknown}"
    args = parser.parse_args(argv)
    pd_workers(args)
    replica_config(args)
    return args


def built_router() -> Router:
    """A router as `python -m router` builds it for deploy/ (KV events subscribed), not
    started (its one worker never answers)."""
    url = "http://127.0.0.1:9"
    args = build_parser().parse_args(["--policy", "round_robin", "--kv-events-subscribe"])
    return build_router(args, [url])


def router_routes() -> set[str]:
    """GET routes of the router as built by `python -m router`."""
    routes = Management(built_router()).routes()
    return {path for path, methods in routes.exact.items() if "GET" in methods}


def probe_routes() -> set[str]:
    """Routes a probe may use: served, and open without the API key."""
    return router_routes() & OPEN_ROUTES


def sample_names(families: Iterable[Any]) -> set[str]:
    """The series names a scrape holds for these metric families (a counter's `_total`, a
    histogram's `_bucket`/`_count`/`_sum`), whether or not a labelled child exists yet."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "gauge": ("",),
    }
    return {f.name + s for f in families for s in suffixes.get(f.type, ("",))}


def router_metric_names() -> set[str]:
    """Every series a router with --redis-url exports: its registry as `python -m router`
    builds it, plus the replica metrics its Replicator registers at startup."""
    registry: CollectorRegistry = built_router().metrics.registry
    ReplicaMetrics(registry)
    return sample_names(registry.collect())


def scraped_names(text: str) -> set[str]:
    """Series names of a /metrics exposition (with the empty families' too)."""
    return sample_names(text_string_to_metric_families(text))


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        (DEPLOY / "monitoring" / "grafana-dashboard.json").read_text()
    )
    return data


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold theirs


def dashboard_exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p.get("targets", [])]


def dashboard_metrics(board: dict[str, Any]) -> set[str]:
    return {m for expr in dashboard_exprs(board) for m in METRIC.findall(expr)}


def sglang_source() -> Path | None:
    """The installed SGLang's srt/ directory, found without importing it (its modules pull in
    torch); None when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    srt = Path(next(iter(spec.submodule_search_locations))) / "srt"
    return srt if (srt / "server_args.py").exists() else None


def sglang_flags(srt: Path) -> set[str]:
    """SGLang's server flags, read as text: the literal option strings in server_args.py and
    its field modules, plus one `--field-name` per `field_name: A[...]` dataclass field, which
    SGLang turns into a flag (add_cli_args_from_dataclass)."""
    found: set[str] = set()
    for path in [srt / "server_args.py", *sorted(srt.glob("arg_groups/fields/*.py"))]:
        text = path.read_text()
        found |= set(re.findall(r"""["'](--[a-z0-9][a-z0-9-]*)["']""", text))
        fields = re.findall(r"^\s+(\w+)\s*:\s*A\[", text, re.M)
        found |= {"--" + f.replace("_", "-") for f in fields}
    return found


def sglang_metric_names(srt: Path) -> set[str]:
    """Metric names SGLang's collectors declare (`name="sglang:..."`), read as text."""
    return {
        m for path in srt.rglob("*.py") for m in re.findall(r"\"(sglang:\w+)\"", path.read_text())
    }


def kv_events_config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(value(argv, "--kv-events-config"))
    return config

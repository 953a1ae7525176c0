"""`python -m router --policy prompt-tree`: the locality-aware global router.

Flags keep sglang-router's names where the meaning is the same. With no --worker-urls it
starts a small local cluster of CPU workers (the real tiny model when torch is installed)
and serves it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import math
import os
import signal
import sys
import urllib.request
from pathlib import Path

from localrun.cluster import Cluster, ClusterSpec
from router import tenants
from router.forward.relay import RetryConfig
from router.http_app import RouterApp
from router.http_server import HEADER_READ_TIMEOUT_S, HttpServer, Routes, port_is_free
from router.management import Management
from router.metric_values import use_loop_values
from router.models import build_models, load_models
from router.pd import PDSettings
from router.pd.write_back import WriteBack, WriteBackGate
from router.policies import POLICIES, CostModel, Thresholds, make_policy, policy_name
from router.replicas import ReplicaConfig, ReplicatedTrees, new_replica_id
from router.server import Router, RouterConfig
from router.siblings import SiblingConfig
from router.supervisor import die_with_supervisor, supervise, usable_cores
from router.trees import PromptTrees
from router.workers import BreakerConfig, WorkerRegistry, WorkerType, normalize_url
from shared.pd_caching import Caching
from shared.token_cache import CachedEncoder


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m router",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--worker-urls", nargs="*", default=[], help="workers to route to (none: start local ones)")
    a("--policy", default="prompt_tree", help=f"one of {', '.join(sorted(POLICIES))}")
    a("--cache-threshold", type=float, default=0.3)
    a("--balance-abs-threshold", type=int, default=64)
    a("--balance-rel-threshold", type=float, default=1.5)
    a(
        "--api-key",
        default=os.environ.get("MEMSERVE_ROUTER_API_KEY") or None,
        help="clients must send 'Authorization: Bearer KEY' (default: $MEMSERVE_ROUTER_API_KEY, "
        "which, unlike a flag, other users' ps does not show)",
    )
    a(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants and their hashed API keys, limits and public prefixes (JSON or TOML; "
        "default: $MEMSERVE_ROUTER_TENANTS, a path or the JSON itself): the router mints "
        "each tenant's cache_salt; reloaded when the file changes and on SIGHUP; --api-key "
        "stays the operator's key (every route). See docs/router/tenants.md",
    )
    a(
        "--tenant-secret",
        default=None,
        help="key of the HMAC that mints tenants' salts; every replica and process must share "
        f"it (default: ${tenants.SECRET_ENV}, else a random one for this run)",
    )
    a("--max-payload-size", type=int, default=512 * 1024 * 1024, help="bytes")
    a(
        "--header-read-timeout-secs",
        type=float,
        default=HEADER_READ_TIMEOUT_S,
        help="a request's head must arrive within this, and an idle keep-alive connection "
        "is closed after it (router.http_server)",
    )
    a("--request-timeout-secs", type=float, default=1800)
    a("--max-concurrent-requests", type=int, default=0, help="0: unlimited")
    a(
        "--rate-limit-tokens-per-second",
        type=float,
        default=0,
        help="requests admitted a second (a token bucket, as sglang-router's); 0: unlimited",
    )
    a("--queue-size", type=int, default=100, help="requests that may wait to be admitted")
    a("--queue-timeout-secs", type=float, default=60, help="the longest one may wait")
    a(
        "--max-expected-wait-secs",
        type=float,
        default=0,
        metavar="SECS",
        help="admission by expected wait (0: off): while every worker a request may go to "
        "(colocated, or PD prefill) is expected to start it only after SECS (the cost model's "
        "queue term: queued prefill tokens, running requests), hold it in the queue "
        "(--queue-size, --queue-timeout-secs) until one is within SECS; refuse it with 429 "
        "at once when its wait past SECS exceeds --queue-timeout-secs (or the queue is "
        "full), Retry-After being that excess rounded up; --queue-size 0 refuses at once",
    )
    a("--retry-max-retries", type=int, default=5)
    a("--retry-initial-backoff-ms", type=float, default=50)
    a("--retry-max-backoff-ms", type=float, default=30000)
    a("--retry-backoff-multiplier", type=float, default=1.5)
    a("--retry-jitter-factor", type=float, default=0.2)
    a("--disable-retries", action="store_true")
    a("--cb-failure-threshold", type=int, default=10)
    a("--cb-success-threshold", type=int, default=3)
    a("--cb-timeout-duration-secs", type=float, default=60)
    a("--disable-circuit-breaker", action="store_true")
    a("--health-check-interval-secs", type=float, default=60)
    a("--health-failure-threshold", type=int, default=3)
    a("--health-success-threshold", type=int, default=2)
    a("--health-check-timeout-secs", type=float, default=5)
    a(
        "--load-check-interval-secs",
        type=float,
        default=1.0,
        help="read every worker's /v1/loads this often, for the queues the policies and "
        "admission weigh (0: only with the health checks)",
    )
    a("--prometheus-port", type=int, default=None, help="also serve /metrics on this port")
    a("--prometheus-host", default="127.0.0.1")
    a(
        "--tokenizer-path",
        type=Path,
        default=None,
        help="model directory with tokenizer.json (default: ask the workers' /get_model_info)",
    )
    a(
        "--models",
        default=None,
        metavar="FILE",
        help="several models behind this router: a TOML (or JSON) file of [[model]] tables "
        "(name, tokenizer_path, policy, cache/balance thresholds, worker_urls); the first is "
        "the default one (router.models)",
    )
    a(
        "--kv-events-bind",
        default=None,
        help="bind a ZMQ SUB socket here (e.g. tcp://127.0.0.1:5557) for workers' KV events; "
        "each worker publishes to it with its own URL as the topic",
    )
    a(
        "--kv-events-subscribe",
        action="store_true",
        help="subscribe to every worker's KV events where its /get_server_info says it binds "
        '(kv_events_config endpoint tcp://*:PORT, or a concrete address with "bind": true; '
        "replay_endpoint for gaps): every router replica receives every event",
    )
    cost = CostModel()
    a(
        "--engine-speed",
        choices=["learned", "fixed"],
        default="learned",
        help="cost model: learn each worker's speed from the times to first token the router "
        "measures (a multiple of each figure below per worker, and the overhead every request "
        "pays there), or take those figures as every worker's",
    )
    a(
        "--prefill-secs-per-token",
        type=float,
        default=cost.prefill_s_per_token,
        help="cost model: seconds a worker takes to prefill one uncached prompt token "
        "(default: a Llama-3.1-8B on an H100, as the sim models it)",
    )
    a(
        "--prefill-secs-per-token-pair",
        type=float,
        default=cost.prefill_s_per_token_pair,
        help="cost model: attention's seconds per (new token, context token) pair in a prefill",
    )
    a(
        "--transfer-secs-per-token",
        type=float,
        default=cost.transfer_s_per_token,
        help="cost model: seconds to move one token's KV between instances",
    )
    a(
        "--host-load-secs-per-token",
        type=float,
        default=cost.host_load_s_per_token,
        help="cost model: seconds to load one token's KV from a worker's host tier to its GPU",
    )
    a(
        "--lora-load-secs",
        type=float,
        default=cost.lora_load_s,
        help="cost model: seconds a worker takes to load a LoRA adapter it does not hold "
        "(a request for it pays them there before its prefill)",
    )
    a(
        "--disable-mempool-pull",
        action="store_true",
        help="never name a longer prefix's holder for a MemPool pull (workers recompute)",
    )
    a(
        "--busy-secs-per-request",
        type=float,
        default=cost.busy_s_per_request,
        help="cost model: delay each running request adds in front of a new prefill",
    )
    a("--tree-ttl-secs", type=float, default=300)
    a("--max-tree-size", type=int, default=1 << 20, help="pages per prompt tree")
    a("--page-size", type=int, default=16, help="must equal the workers' page size")
    a(
        "--pd-disaggregation",
        action="store_true",
        help="route to prefill/decode pairs (implied by --prefill/--decode)",
    )
    a(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and its bootstrap port (or 'none'); repeat for more",
    )
    a("--decode", action="append", default=[], metavar="URL", help="a decode worker; repeat")
    a("--prefill-policy", default=None, help="policy for prefill workers (default: --policy)")
    a("--decode-policy", default=None, help="policy for decode workers (default: --policy)")
    a(
        "--pd-caching",
        default="caching-3",
        help="the workers' caching mode (basic, caching-1, caching-2, caching-3): which prompt "
        "trees learn what after a PD request",
    )
    a(
        "--write-back",
        choices=[m.value for m in WriteBack],
        default=WriteBack.ADAPTIVE.value,
        help="PD-Caching-3: 'adaptive' asks a decode to write a request's KV back to its "
        "prefill while the prefill reports reusing written-back pages (one in 8 requests "
        "otherwise, to keep measuring); 'always' asks every time",
    )
    a(
        "--redis-url",
        default=None,
        help="share prompt-tree updates, in-flight load and added/removed workers with other "
        "router replicas through this Redis (e.g. redis://127.0.0.1:6379/0)",
    )
    a("--replica-id", default=None, help="this replica's name in Redis (default: random)")
    a("--redis-namespace", default="memserve", help="prefix of the replicas' Redis keys")
    a(
        "--replica-snapshot-secs",
        type=float,
        default=10,
        help="how often one replica writes the trees' snapshot a starting replica reads",
    )
    a(
        "--processes",
        type=int,
        default=None,
        help="router processes serving the port together (SO_REUSEPORT), each with its own "
        "event loop, all deciding on one shared state (default: $MEMSERVE_ROUTER_PROCESSES, "
        "else the cores this process may use; 1 with --redis-url; 1: one process, no "
        "supervisor)",
    )
    a("--process-index", type=int, default=None, help=argparse.SUPPRESS)  # set for children
    a("--process-count", type=int, default=None, help=argparse.SUPPRESS)
    a("--process-dir", type=Path, default=None, help=argparse.SUPPRESS)
    a("--local-workers", type=int, default=2, help="workers to start when none are named")
    a("--local-backend", choices=["auto", "hf", "sim"], default="auto")
    a("--log-level", default="warning")
    return p


def pd_workers(args: argparse.Namespace) -> tuple[list[tuple[str, int | None]], list[str]]:
    """(--prefill URL [BOOTSTRAP_PORT] entries, --decode URLs); SystemExit on misuse."""
    prefills = []
    for entry in args.prefill:
        if len(entry) > 2:
            raise SystemExit(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        port: int | None = None
        if len(entry) == 2 and entry[1].lower() != "none":
            try:
                port = int(entry[1])
            except ValueError:
                raise SystemExit(f"--prefill {entry[0]}: bootstrap port {entry[1]!r}") from None
        prefills.append((entry[0], port))
    if (args.pd_disaggregation or prefills or args.decode) and not (prefills and args.decode):
        raise SystemExit("PD disaggregation needs at least one --prefill and one --decode")
    if prefills and args.worker_urls:
        raise SystemExit("give either --worker-urls or --prefill/--decode, not both")
    return prefills, list(args.decode)


def tokenizer_dir(given: Path | str | None, urls: list[str]) -> Path | None:
    """`given` (--tokenizer-path, a model's tokenizer_path), else the first worker's
    tokenizer_path if it is on this machine."""
    if given is not None:
        return Path(given)
    for url in urls:
        try:
            with urllib.request.urlopen(url + "/get_model_info", timeout=10) as resp:
                path = Path(json.load(resp).get("tokenizer_path") or "")
        except (OSError, ValueError):
            continue
        if (path / "tokenizer.json").exists():
            return path
    return None


def load_encoder(path: Path | None) -> CachedEncoder | None:
    if path is None:
        return None
    from shared.tokenizer import ChatTokenizer

    encoder = CachedEncoder(ChatTokenizer(path))
    encoder.start_thread()  # before anything else starts the tokenizer's thread pool
    return encoder


def check_limits(args: argparse.Namespace) -> None:
    """Admission and timeout flags must be numbers that make sense; SystemExit otherwise."""
    for flag, value in (
        ("--max-concurrent-requests", args.max_concurrent_requests),
        ("--rate-limit-tokens-per-second", args.rate_limit_tokens_per_second),
        ("--queue-size", args.queue_size),
        ("--retry-max-retries", args.retry_max_retries),
        ("--load-check-interval-secs", args.load_check_interval_secs),
    ):
        if not value >= 0:
            raise SystemExit(f"{flag} must be >= 0, got {value}")
    if not 0 <= args.max_expected_wait_secs < math.inf:
        raise SystemExit(
            "--max-expected-wait-secs must be a number of seconds >= 0 (0: off), "
            f"got {args.max_expected_wait_secs}"
        )
    for flag, value in (
        ("--queue-timeout-secs", args.queue_timeout_secs),
        ("--request-timeout-secs", args.request_timeout_secs),
        ("--max-payload-size", args.max_payload_size),
        ("--header-read-timeout-secs", args.header_read_timeout_secs),
        ("--health-check-interval-secs", args.health_check_interval_secs),
    ):
        if not value > 0:
            raise SystemExit(f"{flag} must be > 0, got {value}")


def processes(args: argparse.Namespace) -> int:
    """How many router processes: --processes, else $MEMSERVE_ROUTER_PROCESSES, else 1 with
    --redis-url, else the usable cores; SystemExit for a count below 1."""
    given = args.processes
    env = os.environ.get("MEMSERVE_ROUTER_PROCESSES")
    if given is None and env:
        try:
            given = int(env)
        except ValueError:
            why = f"MEMSERVE_ROUTER_PROCESSES must be a whole number, got {env!r}"
            raise SystemExit(why) from None
    if given is None:
        return 1 if args.redis_url else usable_cores()
    if given < 1:
        raise SystemExit(f"--processes must be a whole number >= 1, got {given}")
    if given > 1 and args.redis_url:
        raise SystemExit(
            "--processes > 1 with --redis-url is not supported: run one router process per "
            "replica (--processes 1), each with its own --replica-id"
        )
    return int(given)


def sibling_config(args: argparse.Namespace) -> SiblingConfig | None:
    """A child of the supervisor: its place among the router's processes."""
    if args.process_index is None:
        return None
    count, directory = args.process_count, args.process_dir
    if count is None or directory is None or not 0 <= args.process_index < count:
        raise SystemExit("--process-index needs --process-count above it and --process-dir")
    return SiblingConfig(args.process_index, count, directory)


def share(total: float, siblings: SiblingConfig | None) -> float:
    """This process's share of a router-wide limit (0, unlimited, stays 0): an even split,
    whole numbers spread so they add up to `total`, at least 1 each."""
    if siblings is None or not total:
        return total
    if isinstance(total, float) and not total.is_integer():
        return total / siblings.count
    n, count = int(total), siblings.count
    return max(n // count + (1 if siblings.index < n % count else 0), 1)


def check_args(args: argparse.Namespace) -> str:
    """Every check that needs no worker: the policy's canonical name; SystemExit with a
    message for a bad value (the supervisor runs it before starting any process)."""
    try:
        name = policy_name(args.policy)
        for other in (args.prefill_policy, args.decode_policy):
            if other is not None:
                policy_name(other)
        Caching.parse(args.pd_caching)
        for url in args.worker_urls:
            normalize_url(url)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    check_limits(args)
    pd_workers(args)
    replica_config(args)
    cost_model(args)
    processes(args)
    check_tenants(args)
    if args.models:
        load_models(args.models)
    return name


def check_tenants(args: argparse.Namespace) -> None:
    """--tenants: the file must parse (its public prefixes are counted once the tokenizer is
    loaded); SystemExit with what is wrong."""
    given = args.tenants or os.environ.get(tenants.TENANTS_ENV) or None
    if given is None:
        return
    try:
        if given.lstrip().startswith("{"):
            tenants.parse(given, tenants.TENANTS_ENV)
        else:
            try:
                text = Path(given).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise tenants.TenantsError(f"cannot read {given}: {exc}") from None
            tenants.parse(text, given)
    except tenants.TenantsError as exc:
        raise SystemExit(f"--tenants: {exc}") from None


def build_router(args: argparse.Namespace, urls: list[str]) -> Router:
    name = check_args(args)
    siblings = sibling_config(args)
    registry = WorkerRegistry(
        BreakerConfig(
            args.cb_failure_threshold,
            args.cb_success_threshold,
            args.cb_timeout_duration_secs,
            not args.disable_circuit_breaker,
        ),
        args.health_check_interval_secs,
        args.health_failure_threshold,
        args.health_success_threshold,
        args.health_check_timeout_secs,
        args.load_check_interval_secs,
        args.engine_speed == "learned",
    )
    for url in urls:
        try:
            registry.add(url)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    prefills, decodes = pd_workers(args)
    try:
        for url, port in prefills:
            registry.add(url, WorkerType.PREFILL, port)
        for url in decodes:
            registry.add(url, WorkerType.DECODE)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    specs = load_models(args.models) if args.models else []
    for spec in specs:
        for url in spec.worker_urls:
            try:
                registry.add(url).model_id = spec.name
            except ValueError as exc:
                raise SystemExit(f"--models: {exc}") from None
    replica = replica_config(args)
    shared = replica is not None or siblings is not None
    trees = (ReplicatedTrees if shared else PromptTrees)(
        args.page_size, args.tree_ttl_secs, args.max_tree_size
    )
    thresholds = Thresholds(
        args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold
    )
    cost = cost_model(args)
    pulls = not args.disable_mempool_pull
    policy = make_policy(name, trees, thresholds, cost, pulls)
    pd = None
    if prefills:
        try:
            pd = PDSettings(
                Caching.parse(args.pd_caching),
                make_policy(args.prefill_policy or name, trees, thresholds, cost, pulls),
                make_policy(args.decode_policy or name, trees, thresholds, cost, pulls),
                pulls,
                WriteBackGate(WriteBack(args.write_back)),
            )
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        policy = pd.prefill_policy
    if specs:  # the default model's tokenizer, from the file, else as without --models
        given = specs[0].tokenizer_path or args.tokenizer_path
        encoder = load_encoder(tokenizer_dir(given, [*specs[0].worker_urls, *urls]))
    else:
        encoder = load_encoder(tokenizer_dir(args.tokenizer_path, list(registry.workers)))
    if encoder is None and policy.uses_tokens:
        raise SystemExit(
            f"--policy {name} routes on tokens: give --tokenizer-path (a model "
            "directory with tokenizer.json) or workers whose /get_model_info "
            "names a local tokenizer_path"
        )
    process = (0, 1) if siblings is None else (siblings.index, siblings.count)
    tenant_keys = tenants.from_args(
        args.tenants, args.tenant_secret, args.api_key, encoder, replica is not None, process
    )
    config = RouterConfig(
        api_key=args.api_key,
        tenants=tenant_keys,
        max_payload_bytes=args.max_payload_size,
        request_timeout_s=args.request_timeout_secs,
        # each process admits its share; the expected-wait deadline needs none: every
        # process sees every process's load
        max_concurrent_requests=int(share(args.max_concurrent_requests, siblings)),
        rate_limit_per_s=float(share(float(args.rate_limit_tokens_per_second), siblings)),
        queue_size=int(share(args.queue_size, siblings)),
        queue_timeout_s=args.queue_timeout_secs,
        max_expected_wait_s=args.max_expected_wait_secs,
        retry=RetryConfig(
            args.retry_max_retries,
            args.retry_initial_backoff_ms / 1000,
            args.retry_max_backoff_ms / 1000,
            args.retry_backoff_multiplier,
            args.retry_jitter_factor,
            not args.disable_retries,
        ),
        kv_events_endpoint=args.kv_events_bind,
        kv_events_subscribe=args.kv_events_subscribe,
        cost=cost,
        replica=replica,
        siblings=siblings,
    )
    models = None
    if specs:
        models = build_models(
            specs,
            lambda m: make_policy(m.policy or name, trees, m.thresholds(thresholds), cost, pulls),
            lambda m: (
                encoder
                if m is specs[0]
                else load_encoder(tokenizer_dir(m.tokenizer_path, m.worker_urls))
            ),
            policy.uses_tokens,
        )
    return Router(config, registry, trees, policy, encoder, pd, models)


def replica_config(args: argparse.Namespace) -> ReplicaConfig | None:
    """--redis-url and its companions; None without it."""
    if args.redis_url is None:
        return None
    if not args.replica_snapshot_secs > 0:
        raise SystemExit(f"--replica-snapshot-secs must be > 0, got {args.replica_snapshot_secs}")
    return ReplicaConfig(
        args.redis_url,
        args.replica_id or new_replica_id(),
        args.redis_namespace,
        snapshot_interval_s=args.replica_snapshot_secs,
    )


def cost_model(args: argparse.Namespace) -> CostModel:
    """The policies' expected-TTFT terms from the flags; SystemExit for non-positive ones."""
    values = {
        "--prefill-secs-per-token": args.prefill_secs_per_token,
        "--transfer-secs-per-token": args.transfer_secs_per_token,
        "--busy-secs-per-request": args.busy_secs_per_request,
        "--host-load-secs-per-token": args.host_load_secs_per_token,
        "--prefill-secs-per-token-pair": args.prefill_secs_per_token_pair,
        "--lora-load-secs": args.lora_load_secs,
    }
    for flag, value in values.items():
        if not value >= 0:
            raise SystemExit(f"{flag} must be a number >= 0, got {value}")
    return CostModel(
        prefill_s_per_token=args.prefill_secs_per_token,
        transfer_s_per_token=args.transfer_secs_per_token,
        busy_s_per_request=args.busy_secs_per_request,
        host_load_s_per_token=args.host_load_secs_per_token,
        prefill_s_per_token_pair=args.prefill_secs_per_token_pair,
        lora_load_s=args.lora_load_secs,
    )


async def serve(router: Router, args: argparse.Namespace) -> None:
    await router.start()  # with siblings: once they all hear each other
    siblings = router.config.siblings
    management = Management(router)
    app = RouterApp(router, management.routes(), router.process_headers())
    timeout = args.header_read_timeout_secs
    servers = [HttpServer(app, args.host, args.port, timeout)]
    try:
        await servers[0].start()
        settle_heap()
        if siblings is None or not siblings.index:  # the first process speaks for the router
            if args.prometheus_port:
                metrics = Routes()
                metrics.add("GET", "/metrics", management.metrics_text)
                scrape = RouterApp(router, metrics, inference=False)
                servers.append(
                    HttpServer(scrape, args.prometheus_host, args.prometheus_port, timeout)
                )
                await servers[1].start()
            workers = ", ".join(router.registry.workers)
            print(
                f"router ({router.policy.name}) on http://{args.host}:{args.port} -> {workers}",
                flush=True,
            )
        if router.config.tenants is not None:  # SIGHUP: read the tenants file again
            keys = router.config.tenants
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.reload)
        await _wait_for_signal()
    finally:
        for server in servers:
            await server.stop()
        await router.stop()


# A request leaves a few container objects to the cyclic collector (tree nodes, futures);
# at the default threshold (700) it ran about 60 times a second at max load, some 3% of the
# router's CPU, each time walking what startup built. Raised, and startup's objects frozen.
GC_GEN0_THRESHOLD = 10_000


def settle_heap() -> None:
    """Once serving: what startup built (modules, tokenizer, templates) out of the cyclic
    collector's reach, and collections of the young generation less frequent."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: local workers are stopped too
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None) -> None:
    raw = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(raw)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.process_index is not None:
        die_with_supervisor()
    count = 1 if args.process_index is not None else processes(args)
    if count > 1:
        check_args(args)
        if (args.tenants or os.environ.get(tenants.TENANTS_ENV)) and not (
            args.tenant_secret or os.environ.get(tenants.SECRET_ENV)
        ):  # the processes must mint the same salts: one random secret for all of them
            os.environ[tenants.SECRET_ENV] = tenants.load_secret(None, False).decode()
    if args.process_index is None:  # the processes of one router share it; nobody else may
        for host, port in ((args.host, args.port), (args.prometheus_host, args.prometheus_port)):
            if port and not port_is_free(host, port):
                raise SystemExit(f"{host}:{port} is already in use")
    cluster = None
    urls = list(args.worker_urls)
    if not urls and not args.prefill and not args.decode and not args.models:
        spec = ClusterSpec(
            "local",
            colocated=args.local_workers,
            backend=args.local_backend,
            worker_args=("--page-size", str(args.page_size)),
        )
        cluster = Cluster.create(spec, model_dir=None, log_dir=None)
        try:
            urls = cluster.start(timeout_s=300)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from exc
    if count > 1:
        try:
            sys.exit(supervise([*raw, "--worker-urls", *urls] if cluster else raw, count))
        finally:
            if cluster is not None:
                cluster.stop()
    if args.process_index is None and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        use_loop_values()  # one process: its metrics are moved on one thread
    try:
        router = build_router(args, urls)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        asyncio.run(serve(router, args))
    except KeyboardInterrupt:
        pass
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()

"""`python -m connector.worker`: start one SGLang-compatible worker on MemPool.

Flags keep SGLang's names where the meaning is the same (--model-path, --host, --port,
--page-size, --max-running-requests, --max-prefill-tokens, --max-total-tokens,
--disable-radix-cache, --enable-hierarchical-cache, --hicache-ratio, --hicache-size,
--chunked-prefill-size, --kv-events-config, --disaggregation-mode,
--disaggregation-bootstrap-port, --disaggregation-transfer-backend, --served-model-name,
--context-length, --lora-paths, --max-loaded-loras, --max-loras-per-batch,
--lora-eviction-policy, --enable-lora; --init-new-token-ratio, --min-new-token-ratio,
--new-token-ratio-decay, which SGLang 0.5.23 reads from environment variables). Ours:
--pd-caching (MemServe's caching modes of a disaggregated pair), --mempool-port,
--mempool-secret, --cluster-redis, --enable-mempool-pull, --mempool-pull-timeout-secs,
--tokenizer-cache, --backend, --time-scale, --sim-interconnect-gbps, --sim-lora-size-mb.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
from pathlib import Path
from typing import Any

from aiohttp import web

from connector.worker.admission import TokenRatio
from connector.worker.backend import Backend
from connector.worker.hooks import ChainedHooks, RequestHooks
from connector.worker.kv_cache import KVCache, host_tier_tokens
from connector.worker.lora import LoRAError, LoRARegistry, parse_lora_path
from connector.worker.pd import PDConfig, PDLink, PDMode
from connector.worker.pd_hooks import PDHooks
from connector.worker.pull import PullConfig, PullHooks
from connector.worker.scheduler import Scheduler, SchedulerConfig
from connector.worker.server import WorkerInfo, WorkerServer
from mempool import MemPool
from mempool.transfer.base import TransferFailed
from shared.kv_events import KVEventPublisher, KVEventsConfig
from shared.path_shares import PathShares
from shared.pd_caching import Caching
from shared.tokenizer import ChatTokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m connector.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        choices=["sim", "hf"],
        default="sim",
        help="sim: latency model; hf: the real tiny model on CPU",
    )
    p.add_argument(
        "--model-path",
        type=Path,
        default=None,
        help="HF model directory (default: SmolLM2-135M-Instruct, converted once)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV cache capacity in tokens (default: sim, what the modelled GPU holds; hf, 16384)",
    )
    p.add_argument(
        "--max-cached-tokens-per-salt",
        type=int,
        default=0,
        help="KV tokens the requests of one salt group (a cache_salt up to its first ':', "
        "a router's tenant salt) may keep cached; over it the group's own least recently "
        "cached paths go first, so a tenant sending a fresh salt on every request cannot "
        "evict the others' cache (0: no bound)",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no context caching: every prompt is computed in full",
    )
    p.add_argument(
        "--enable-hierarchical-cache",
        "--enable-hicache",
        dest="enable_hierarchical_cache",
        action="store_true",
        help="SGLang's HiCache: a host DRAM tier behind the device KV (--max-total-tokens); "
        "evicted device pages are swapped out to it, host hits are loaded back before prefill",
    )
    p.add_argument(
        "--hicache-ratio",
        type=float,
        default=None,
        help="host tier capacity as a multiple of the device tier's (default 2.0, as SGLang)",
    )
    p.add_argument(
        "--hicache-size",
        type=int,
        default=None,
        help="host tier size in GB (decimal; overrides --hicache-ratio when > 0; sim: GB of "
        "the modelled pages)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prompt tokens prefilled per step, a longer prompt over several steps (SGLang's "
        "flag; -1 or <= 0 disables; default: sim 8192, SGLang's for an 80 GB H100; hf off)",
    )
    p.add_argument(
        "--init-new-token-ratio",
        type=float,
        default=0.7,
        help="share of its remaining max_new_tokens a running request is first expected to "
        "generate, for admission (SGLang 0.5.23: $SGLANG_INIT_NEW_TOKEN_RATIO, 0.7)",
    )
    p.add_argument(
        "--min-new-token-ratio",
        type=float,
        default=0.098,
        help="the floor it decays to (SGLang: init x $SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR 0.14)",
    )
    p.add_argument(
        "--new-token-ratio-decay",
        type=float,
        default=(0.7 - 0.098) / 600,
        help="decay per decode step without retraction (SGLang: (init - min) / 600 steps); "
        "a retraction raises the ratio to what the running requests generated so far",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="accepted for SGLang compatibility: adapters are served whenever --lora-paths "
        "names some or /load_lora_adapter loads one",
    )
    p.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="SPEC",
        help='LoRA adapters to serve: PATH, NAME=PATH, or JSON {"lora_name": ..., '
        '"lora_path": ..., "pinned": true} (SGLang\'s forms); no backend applies real '
        "adapter weights, KV is keyed per adapter all the same",
    )
    p.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="adapters in memory at once (default: no limit); a request for another one "
        "loads it, evicting an unpinned adapter no running request uses",
    )
    p.add_argument(
        "--max-loras-per-batch",
        type=int,
        default=8,
        help="different adapters in one running batch (SGLang's default 8)",
    )
    p.add_argument(
        "--lora-eviction-policy",
        choices=["lru", "fifo"],
        default="lru",
        help="which loaded adapter makes room: least recently used, or first loaded",
    )
    p.add_argument(
        "--sim-lora-size-mb",
        type=float,
        default=84.0,
        help="sim: bytes of one adapter's weights, in MB (default 84: rank 16 on every "
        "linear layer of Llama-3.1-8B); loading one costs the latency model's "
        "lora_load_latency_s plus this at lora_load_bytes_per_s (NVMe, 2 GB/s)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help='SGLang JSON, e.g. \'{"publisher":"zmq","endpoint":"tcp://*:5557"}\'',
    )
    p.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default="null",
        help="null: a colocated instance (SGLang's default); prefill or decode: one side "
        "of a disaggregated pair (the router adds SGLang's bootstrap fields)",
    )
    p.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="prefill: where decode instances claim rooms (SGLang's default 8998)",
    )
    p.add_argument(
        "--disaggregation-transfer-backend",
        choices=["mempool", "fake"],
        default="mempool",
        help="mempool: KV moves through MemPool's transfer agents; fake: no KV moves and "
        "each side computes alone (SGLang's test backend)",
    )
    p.add_argument(
        "--pd-caching",
        default="caching-3",
        help="MemServe table 4: basic (no caching), caching-1 (prefill caches), caching-2 "
        "(+ decode caches, prefill sends only what decode lacks), caching-3 (+ decode writes "
        "its KV back to prefill: the default)",
    )
    p.add_argument("--mempool-port", type=int, default=0, help="MemPool agent port (0: any)")
    p.add_argument(
        "--mempool-transport",
        choices=["auto", "tcp", "rdma", "mooncake"],
        default="auto",
        help="MemPool's data plane between PD instances: auto picks RDMA (pyverbs) when the "
        "machine has a device, else TCP",
    )
    p.add_argument(
        "--mempool-secret",
        default=os.environ.get("MEMSERVE_MEMPOOL_SECRET"),
        help="shared secret for MemPool transfers (default: $MEMSERVE_MEMPOOL_SECRET)",
    )
    p.add_argument(
        "--cluster-redis",
        default=None,
        metavar="URL",
        help="PD or pulls: join MemPool membership in Redis (e.g. redis://127.0.0.1:6379/0): "
        "heartbeats, peers looked up there, a dead peer's allocations freed (default: "
        "in-process, peers known from room claims or the router's hints)",
    )
    p.add_argument(
        "--enable-mempool-pull",
        action="store_true",
        help="colocated or prefill: run a MemPool agent that serves this instance's cached "
        "prefixes to peers (a prefill: its PD agent), and pull a longer prefix the router "
        "names (memserve.prefix_holders) before prefill when moving it is expected faster "
        "than computing it",
    )
    p.add_argument(
        "--mempool-pull-timeout-secs",
        type=float,
        default=3.0,
        help="longest pull of a remote prefix (plus its modelled wire time); a holder that "
        "refuses, dies or stalls costs a recompute",
    )
    p.add_argument(
        "--disaggregation-timeout-secs",
        type=float,
        default=30.0,
        help="longest wait for the other side of a bootstrap room",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="sim: multiply simulated GPU time (0: no sleeping)",
    )
    p.add_argument(
        "--sim-interconnect-gbps",
        type=float,
        default=None,
        help="sim, PD: speed of the modelled KV interconnect in Gb/s (default: the latency "
        "model's RDMA, 200); the bytes moved are a stand-in, their time is modelled",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="hf: torch threads (default: this process's CPU share, at most 4)",
    )
    p.add_argument(
        "--instance-id",
        type=int,
        default=None,
        help="MemPool instance id (0..65535; default: 0, or a random one for a prefill or "
        "decode instance, whose peers must have other ids)",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="accepted for SGLang compatibility; cached_tokens is always reported",
    )
    p.add_argument(
        "--tokenizer-cache",
        action="store_true",
        help="encode chat history with the router's exact per-piece token cache "
        "(shared/token_cache.py) instead of a full encode per request; off by default, "
        "as in SGLang",
    )
    p.add_argument("--log-level", default="warning")
    return p


def make_backend(args: argparse.Namespace, model_dir: Path, tokenizer: ChatTokenizer) -> Backend:
    if args.backend == "hf":
        from connector.worker.backend_hf import HFBackend  # torch only when asked for

        return HFBackend(model_dir, page_size=args.page_size, threads=args.threads)
    from connector.worker.backend_sim import SimBackend

    try:
        model = SimBackend.model_with_interconnect(args.sim_interconnect_gbps)
    except ValueError as exc:
        raise SystemExit(f"--sim-interconnect-gbps: {exc}") from None
    return SimBackend(
        tokenizer,
        page_size=args.page_size,
        time_scale=args.time_scale,
        model=model,
        # KV that moves (PD, host tier, pulls) is stand-in bytes, its time modelled.
        stand_in=args.disaggregation_mode != "null"
        or args.enable_hierarchical_cache
        or args.enable_mempool_pull,
        lora_bytes=args.sim_lora_size_mb * 1e6,
        **({"context_length": args.context_length} if args.context_length else {}),
    )


def check_tier_args(args: argparse.Namespace) -> None:
    """The host tier's and chunked prefill's flags, checked before the model loads; the
    defaults resolved into `args` (as /get_server_info reports them)."""
    if not args.enable_hierarchical_cache:
        for flag, value in (
            ("--hicache-ratio", args.hicache_ratio),
            ("--hicache-size", args.hicache_size),
        ):
            if value is not None:
                raise SystemExit(f"{flag} needs --enable-hierarchical-cache")
    elif args.disable_radix_cache:
        raise SystemExit(
            "--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)"
        )
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = 8192 if args.backend == "sim" else -1
    if 0 < args.chunked_prefill_size < args.page_size:
        raise SystemExit(
            f"--chunked-prefill-size {args.chunked_prefill_size} is below a page "
            f"(--page-size {args.page_size}): use >= {args.page_size}, or <= 0 to disable"
        )


def check_pull_args(args: argparse.Namespace, mode: PDMode, caching: Caching) -> None:
    """Pulls of remote prefixes: a colocated instance, or a PD prefill that caches and moves
    KV over MemPool, with its radix cache."""
    if not args.enable_mempool_pull:
        return
    if mode is PDMode.DECODE:
        raise SystemExit(
            "--enable-mempool-pull: a decode instance does not pull (its KV comes from the "
            "prefill; a prefill or a colocated instance pulls)"
        )
    if mode is PDMode.PREFILL and not caching.prefill_caches:
        raise SystemExit(
            "--enable-mempool-pull on a prefill needs a --pd-caching mode in which it caches "
            "(caching-1, -2 or -3; with basic it keeps nothing a pull could bring)"
        )
    if mode is PDMode.PREFILL and args.disaggregation_transfer_backend != "mempool":
        raise SystemExit(
            "--enable-mempool-pull on a prefill needs --disaggregation-transfer-backend "
            "mempool (its pulls use the same MemPool agent)"
        )
    if args.disable_radix_cache:
        raise SystemExit("--enable-mempool-pull needs the radix cache (drop --disable-radix-cache)")
    if not args.mempool_pull_timeout_secs > 0:
        raise SystemExit(
            f"--mempool-pull-timeout-secs must be positive, got {args.mempool_pull_timeout_secs}"
        )


def host_tier_blocks(args: argparse.Namespace, backend: Backend, device_blocks: int) -> int:
    """Blocks of the host tier for --hicache-ratio / --hicache-size; SystemExit if unusable."""
    page = args.page_size
    try:
        tokens = host_tier_tokens(
            device_blocks * page,
            args.hicache_ratio,
            args.hicache_size,
            backend.kv_bytes_per_token(),
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if tokens < page:
        raise SystemExit(
            f"the host tier would hold {tokens} tokens, less than a page of {page}: raise "
            "--hicache-ratio or --hicache-size"
        )
    return tokens // page


def lora_registry(args: argparse.Namespace) -> LoRARegistry:
    """The adapters of --lora-paths under SGLang's limits; SystemExit naming what is wrong."""
    if not args.sim_lora_size_mb >= 0:
        raise SystemExit(f"--sim-lora-size-mb must be >= 0, got {args.sim_lora_size_mb}")
    try:
        refs = [parse_lora_path(spec) for spec in args.lora_paths]
        return LoRARegistry(
            refs, args.max_loaded_loras, args.max_loras_per_batch, args.lora_eviction_policy
        )
    except LoRAError as exc:
        raise SystemExit(str(exc)) from None


def token_ratio(args: argparse.Namespace) -> TokenRatio:
    """SGLang's new-token ratio from the three flags; SystemExit naming what is wrong."""
    try:
        return TokenRatio(
            args.init_new_token_ratio, args.min_new_token_ratio, args.new_token_ratio_decay
        )
    except ValueError as exc:
        raise SystemExit(f"--init-new-token-ratio/--min-new-token-ratio: {exc}") from None


def build(args: argparse.Namespace) -> tuple[web.Application, dict[str, Any]]:
    """Everything a worker is, from its arguments; raises SystemExit with a message on misuse."""
    try:
        caching = Caching.parse(args.pd_caching)
    except ValueError as exc:
        raise SystemExit(f"--pd-caching: {exc}") from None
    mode = PDMode(args.disaggregation_mode)
    if args.page_size <= 0:
        raise SystemExit("--page-size must be positive")
    check_pull_args(args, mode, caching)
    if args.instance_id is None:  # a pair of defaults would both be 0 and refuse each other
        alone = mode is PDMode.NULL and not args.enable_mempool_pull
        args.instance_id = 0 if alone else random.randrange(1, 1 << 16)
    if args.cluster_redis and mode is PDMode.NULL and not args.enable_mempool_pull:
        raise SystemExit(
            "--cluster-redis: only prefill and decode instances, and colocated ones with "
            "--enable-mempool-pull, join membership"
        )
    check_tier_args(args)
    if args.max_cached_tokens_per_salt < 0:
        raise SystemExit(
            "--max-cached-tokens-per-salt must be a number of tokens >= 0 (0: no bound)"
        )
    lora = lora_registry(args)
    if args.model_path is None:
        from connector.model_files import ensure_hf_model

        model_dir = ensure_hf_model()
    else:
        model_dir = args.model_path
    if not (model_dir / "tokenizer.json").exists():
        raise SystemExit(f"--model-path {model_dir}: no tokenizer.json there")
    tokenizer = ChatTokenizer(model_dir)
    backend = make_backend(args, model_dir, tokenizer)
    if args.context_length:
        backend.context_length = args.context_length
    if args.max_total_tokens is not None:
        capacity = args.max_total_tokens
    else:
        default = backend.default_kv_tokens()
        capacity = 16384 if default is None else default
    blocks = max(capacity // args.page_size, 1)
    simulated = args.backend == "sim"
    host_blocks, device_blocks = blocks, 0
    if args.enable_hierarchical_cache:  # requests on the device tier, a host tier behind it
        host_blocks, device_blocks = host_tier_blocks(args, backend, blocks), blocks
    pool = MemPool(
        args.instance_id,
        backend.spec,
        host_blocks=host_blocks,
        device_blocks=device_blocks,
        huge_pages="off" if simulated else "auto",
        reserve=not simulated,
    )
    backend.attach(pool)
    events = None
    if args.kv_events_config:
        try:
            config = KVEventsConfig.parse(args.kv_events_config)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        if config.publisher == "zmq":
            events = KVEventPublisher(config, args.page_size)
    kv = KVCache(pool, backend, events)
    if args.max_cached_tokens_per_salt:
        salt_pages = max(args.max_cached_tokens_per_salt // args.page_size, 1)
        kv.salt_shares = PathShares(args.page_size, lambda group: salt_pages)
    hooks: RequestHooks = RequestHooks()
    enable_cache = not args.disable_radix_cache
    if mode is not PDMode.NULL:
        pd_config = PDConfig(
            mode,
            caching,
            args.disaggregation_transfer_backend,
            args.host,
            args.disaggregation_bootstrap_port,
            args.host,
            args.mempool_port,
            args.mempool_secret,
            args.disaggregation_timeout_secs,
            args.cluster_redis,
            transport=args.mempool_transport,
        )
        link = PDLink(
            pd_config,
            pool,
            kv.alloc_for_peer,
            backend.wire_model(),
            args.time_scale,
            on_written_back=kv.note_written_back,
        )
        hooks = pd_hooks = PDHooks(link)
        if args.disaggregation_transfer_backend == "mempool":
            side = caching.prefill_caches if mode is PDMode.PREFILL else caching.decode_caches
            enable_cache = enable_cache and side
    if args.enable_mempool_pull:
        pull_config = PullConfig(
            args.host,
            args.mempool_port,
            args.mempool_secret,
            args.mempool_transport,
            args.cluster_redis,
            args.mempool_pull_timeout_secs,
        )
        if mode is PDMode.PREFILL:  # pulls through the PD link's agent, after its hooks
            pulls = PullHooks(pull_config, kv, backend, args.time_scale, shared=link)
            hooks = ChainedHooks([pd_hooks, pulls])
        else:
            hooks = PullHooks(pull_config, kv, backend, args.time_scale)
    scheduler = Scheduler(
        backend,
        kv,
        tokenizer,
        SchedulerConfig(
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            enable_cache=enable_cache,
            ratio=token_ratio(args),
        ),
        hooks,
        lora,
    )
    server_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    server_args["model_path"] = str(model_dir)
    name = args.served_model_name or str(model_dir)
    encoder = None
    if args.tokenizer_cache:
        from shared.token_cache import CachedEncoder

        encoder = CachedEncoder(tokenizer, guesses=False)  # it encodes whole prompts
    info = WorkerInfo(str(model_dir), name, server_args)
    server = WorkerServer(scheduler, tokenizer, info, encoder)
    return server.app(), server_args


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    app, _ = build(args)
    print(f"worker ({args.backend}) serving on http://{args.host}:{args.port}", flush=True)
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    except (TransferFailed, OSError) as exc:  # membership store down, a port taken
        raise SystemExit(f"worker cannot start: {exc}") from None


if __name__ == "__main__":
    main()

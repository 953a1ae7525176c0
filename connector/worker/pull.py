"""A colocated worker pulls a longer prefix from a peer before prefill (MemServe's global reuse).

The router names, in an extra request field, the instances that hold a longer cached prefix
of the prompt than the one it routes to (`"memserve": {"prefix_holders": [...]}`, longest
first, each with its MemPool agent). On submit, this hook compares the best holder's prefix
with the local match; when the missing pages are expected to move faster than they compute
(`PullCost`: the sim's latency model, or for real KV a measured transfer rate against the
backend's prefill estimate), it takes the request over and pulls them with
`TransferAgent.pull` (KVDirect's pull: the holder locks its prefix, we read the pages we lack
into blocks from the engine's allocator, insert them, the holder unlocks), then queues the
request, whose admission finds them in the local cache. The pulled tokens are reported apart
from `cached_tokens`.

A pull is bounded by `timeout_s`: a holder that refuses, times out, dies or cannot be
authenticated costs a recompute, never a failed request, and whatever the pull allocated or
locked, here or at the holder, is released. The same agent serves this instance's cached
prefixes to its peers' pulls.

A request in a cache namespace (`shared/namespaces.py`: a `cache_salt`, an `extra_key`) pulls
by its index key, which the holder's index keyed alike: it gets its own namespace's pages and
the public ones before its salt, never another namespace's (their keys differ from the first
salted page on). An adapter's pages are keyed by each worker's own load of the adapter (a new
id each time), which no peer shares: such a request pulls nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

from connector.worker.backend import Backend
from connector.worker.hooks import Engine, RequestHooks, agent_address
from connector.worker.kv_cache import KVCache
from connector.worker.pd import WireModel, free_arrival, start_agent
from connector.worker.protocol import BadRequest, memserve_options
from connector.worker.sequence import DONE, Sequence
from mempool.transfer.agent import PullResult, TransferAgent
from mempool.transfer.base import PeerInfo
from mempool.transfer.membership import ClusterManager
from mempool.transfer.receiver import Received
from shared.namespaces import key_tokens

log = logging.getLogger(__name__)

MAX_INSTANCE_ID = (1 << 16) - 1


class Holder(NamedTuple):
    """One entry of the router's hint: an instance caching `cached_tokens` of the prompt, and
    where its MemPool agent listens (host and port may be left to membership)."""

    instance_id: int
    cached_tokens: int
    host: str | None
    port: int | None
    url: str | None


def _int(value: Any, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{what} must be at most {high}, got {value!r}")
    return value


def prefix_holders(extras: dict[str, Any]) -> list[Holder]:
    """The holders the router names, longest prefix first; entries without an agent (no
    `instance_id`) are left out. ValueError when the field is malformed."""
    entries = memserve_options(extras).get("prefix_holders")
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ValueError(f"'memserve.prefix_holders' must be a list, got {entries!r}")
    holders = []
    for i, entry in enumerate(entries):
        what = f"memserve.prefix_holders[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{what} must be an object, got {entry!r}")
        cached = _int(entry.get("cached_tokens"), f"{what}.cached_tokens", 0)
        host, port, url = entry.get("host"), entry.get("port"), entry.get("url")
        if host is not None and not isinstance(host, str):
            raise ValueError(f"{what}.host must be a string, got {host!r}")
        if port is not None:
            port = _int(port, f"{what}.port", 1, 65535)
        if url is not None and not isinstance(url, str):
            raise ValueError(f"{what}.url must be a string, got {url!r}")
        if entry.get("instance_id") is None:
            continue  # a holder without a MemPool agent: nothing to pull from
        iid = _int(entry["instance_id"], f"{what}.instance_id", 0, MAX_INSTANCE_ID)
        holders.append(Holder(iid, cached, host, port, url))
    holders.sort(key=lambda h: -h.cached_tokens)
    return holders


@dataclass(slots=True)
class PullConfig:
    agent_host: str = "127.0.0.1"
    agent_port: int = 0
    secret: str | None = None
    transport: str = "auto"
    cluster_redis: str | None = None  # shared membership; None: holders found by the hint
    timeout_s: float = 3.0  # one pull, start to insert (plus its modelled wire time)


@dataclass(slots=True)
class PullStats:
    """What /get_server_info reports under `pull`."""

    pulls: int = 0  # pulls that brought pages
    pulled_tokens: int = 0  # tokens they brought
    failures: int = 0  # refused, timed out, holder gone or unknown: recomputed instead
    refused_slower: int = 0  # not pulled: recomputing was expected to be faster
    empty: int = 0  # the holder had no more of the prompt than we did (a stale hint)
    modelled_s: float = 0.0  # sim: modelled wire time of the pulled pages (slept x scale)
    wall_s: float = 0.0  # measured time of the pulls, lock to insert
    bytes: int = 0  # bytes moved (stand-in bytes for the sim)


class PullCost:
    """Whether pulling pages beats recomputing their tokens.

    Transfer time: `wire(pages)` when the bytes moved stand in for bigger ones (the sim's
    modelled interconnect), else `latency_s` plus the bytes at the transfer rate measured on
    this instance's own pulls (an exponential average, seeded with `bytes_per_s`). Recompute
    time: the backend's estimate (`Backend.recompute_s`), of the missing tokens after the
    local prefix; without one, a pull is assumed to pay.
    """

    def __init__(
        self,
        backend: Backend,
        page_bytes: int,
        wire: WireModel | None,
        latency_s: float = 2e-3,
        bytes_per_s: float = 1e9,
    ) -> None:
        self.backend = backend
        self.page_bytes = page_bytes
        self.wire = wire
        self.latency_s = latency_s
        self.bytes_per_s = bytes_per_s

    def transfer_s(self, pages: int) -> float:
        if self.wire is not None:
            return self.wire(pages)
        return self.latency_s + pages * self.page_bytes / self.bytes_per_s

    def pays(self, pages: int, page_size: int, have_tokens: int) -> bool:
        recompute = self.backend.recompute_s(pages * page_size, have_tokens)
        return recompute is None or self.transfer_s(pages) < recompute

    def observe(self, nbytes: int, seconds: float) -> None:
        """A real pull moved `nbytes` in `seconds` (lock to insert)."""
        if self.wire is None and nbytes > 0 and seconds > 0:
            self.bytes_per_s = 0.8 * self.bytes_per_s + 0.2 * (nbytes / seconds)


class Plan(NamedTuple):
    holder: Holder
    limit: int  # prompt tokens offered to the holder: whole pages, the last token left out


class AgentOwner(Protocol):
    """Another part of the instance that runs its MemPool agent (a PD instance's `PDLink`)."""

    agent: TransferAgent | None
    membership: ClusterManager | None


class PullHooks(RequestHooks):
    """Runs this instance's MemPool agent (or borrows `shared`'s, a PD prefill's, which it
    neither starts nor closes); pulls named longer prefixes before prefill."""

    def __init__(
        self,
        config: PullConfig,
        kv: KVCache,
        backend: Backend,
        time_scale: float = 1.0,
        shared: AgentOwner | None = None,
    ) -> None:
        self.config = config
        self.shared = shared
        self.kv = kv
        self.pool = kv.pool
        self.page = kv.page
        self.time_scale = time_scale
        self.cost = PullCost(backend, self.pool.spec.page_bytes, backend.wire_model())
        self.stats = PullStats()
        self.last_failure: str | None = None
        self.agent: TransferAgent | None = None
        self.membership: ClusterManager | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the agent (joining membership when configured); TransferFailed or OSError,
        everything closed, when that cannot be done. A shared agent is started already."""
        if self.shared is not None:
            self.agent, self.membership = self.shared.agent, self.shared.membership
            if self.agent is None:
                raise RuntimeError("pulls borrow an agent that has not started")
            return
        config = self.config
        self.agent = await start_agent(
            self.pool, config, config.timeout_s, self._on_received, self.kv.alloc_for_peer
        )
        self.membership = self.agent.membership if config.cluster_redis else None

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        agent, membership = self.agent, self.membership
        self.agent = self.membership = None
        if self.shared is not None:  # its owner closes it
            return
        if agent is not None:
            await agent.close()
        if membership is not None:
            await membership.close()

    def _on_received(self, received: Received) -> None:
        """Nobody pushes KV to a colocated instance for a request: what a peer pushes anyway
        is not kept (pages it inserted stay cache, like any other)."""
        free_arrival(self.pool, received)

    # ----------------------------------------------------------------- submit

    def on_submit(self, seq: Sequence, extras: dict[str, Any], engine: Engine) -> bool:
        try:
            holders = prefix_holders(extras)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if not holders or self.agent is None:
            return False
        plan = self._plan(seq, holders)
        if plan is None:
            return False
        task = asyncio.get_running_loop().create_task(self._pull(seq, plan, engine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _plan(self, seq: Sequence, holders: list[Holder]) -> Plan | None:
        """The holder to pull from, or None: no holder has more than we do, or the pull is
        expected to be slower than recomputing (counted)."""
        page, prompt, ns = self.page, seq.prompt_ids, seq.namespace
        if ns is not None and ns.lora_id:  # keyed by this worker's load of the adapter
            return None
        limit = (len(prompt) - 1) // page * page  # the last token is computed anyway
        if limit <= 0:
            return None
        have = len(self.kv.lookup(prompt[:limit], ns)) // self.pool.blocks_per_page * page
        me = self.pool.instance_id
        holder = next((h for h in holders if h.instance_id != me), None)
        if holder is None:
            return None
        target = min(holder.cached_tokens, limit) // page * page
        if target <= have:
            return None
        pages = (target - have) // page
        if not self.cost.pays(pages, page, have):
            self.stats.refused_slower += 1
            return None
        return Plan(holder, limit)

    async def _pull(self, seq: Sequence, plan: Plan, engine: Engine) -> None:
        """Pull, then hand the request back to the scheduler, whatever happened."""
        holder = plan.holder
        started = time.perf_counter()
        modelled = 0.0
        try:
            async with asyncio.timeout(self.config.timeout_s) as deadline:

                async def on_the_wire(pages: int) -> None:
                    nonlocal modelled
                    if self.cost.wire is None:
                        return
                    modelled = self.cost.wire(pages)
                    if modelled and self.time_scale:
                        sleep = modelled * self.time_scale
                        when = deadline.when()
                        if when is not None:  # the wire time is not the holder's fault
                            deadline.reschedule(when + sleep)
                        await asyncio.sleep(sleep)

                agent = await self._peer(holder)
                key = key_tokens(seq.prompt_ids[: plan.limit], seq.namespace, self.page)
                result = await agent.pull(holder.instance_id, key, before_read=on_the_wire)
        except asyncio.CancelledError:  # the worker is stopping: the client hears it now
            seq.finish_reason = {"type": "abort", "message": "the worker is shutting down"}
            seq.events.put_nowait(DONE)
            raise
        except Exception as exc:
            self._failed(seq, holder, exc)
        else:
            self._pulled(seq, result, time.perf_counter() - started, modelled)
        if seq.finish_reason is not None:  # the client left while the KV travelled
            engine.retire(seq, [])
        else:
            engine.enqueue(seq)

    async def _peer(self, holder: Holder) -> TransferAgent:
        """The agent, knowing where the holder listens: from the hint, unless membership
        is shared (then membership says, and a holder it does not know is not pulled from)."""
        agent = self.agent
        if agent is None:
            raise ConnectionError("this instance's MemPool agent is closed")
        if self.membership is None and holder.host and holder.port:
            await agent.add_peer(PeerInfo(holder.instance_id, holder.host, holder.port))
        return agent

    def _failed(self, seq: Sequence, holder: Holder, exc: Exception) -> None:
        why = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            why = f"no pull within {self.config.timeout_s:g} s"
        where = f"instance {holder.instance_id} ({holder.host}:{holder.port})"
        self.stats.failures += 1
        self.last_failure = f"{where}: {why}"
        log.warning("request %s: pulling from %s failed, recomputing: %s", seq.rid, where, why)

    def _pulled(self, seq: Sequence, result: PullResult, seconds: float, modelled: float) -> None:
        if not result.pages_pulled:
            self.stats.empty += 1
            return
        first = result.pages_skipped
        self.kv.note_inserted(seq.prompt_ids, first, result.pages_pulled, ns=seq.namespace)
        seq.pulled_from, seq.pulled_to = first * self.page, result.num_tokens
        stats = self.stats
        stats.pulls += 1
        stats.pulled_tokens += result.pages_pulled * self.page
        stats.bytes += result.bytes
        stats.wall_s += seconds
        stats.modelled_s += modelled
        self.cost.observe(result.bytes, seconds)

    # ----------------------------------------------------------------- reporting

    def server_info(self) -> dict[str, Any]:
        agent = self.agent
        stats: dict[str, Any] = asdict(self.stats)
        for key in ("modelled_s", "wall_s"):
            stats[key] = round(stats[key], 6)
        stats.update(
            served=agent.receiver.pulls_served if agent else 0,
            served_locked_tokens=agent.receiver.pull_tokens_locked if agent else 0,
            last_failure=self.last_failure,
        )
        return {
            "memserve": {
                "kv_pull": agent is not None,
                "serves_pulls": agent is not None,
                "agent": None if agent is None else agent_address(agent),
                "transport": None if agent is None else agent.transport.name,
                "membership": self.config.cluster_redis or "in-process (holders from hints)",
                "pull_timeout_s": self.config.timeout_s,
                "transfer_time": "modelled (stand-in bytes)" if self.cost.wire else "real",
            },
            "pull": stats,
        }

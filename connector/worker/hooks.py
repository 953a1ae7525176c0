"""Where a deployment changes a request's path through the scheduler, and what it may do there.

The scheduler runs every request the same way: submit, admission, steps, finish. A hook
object is called at the two points where one side of a disaggregated pair (or a pull of a
remote prefix before prefill, `pull.PullHooks`) takes a request over: on submit, before it
is queued, and on finish, before its KV becomes cache. What a hook may do to the scheduler
in return is the `Engine` protocol, so hooks never reach into the scheduler's state.
"""

from __future__ import annotations

from typing import Any, Protocol

from connector.worker.kv_cache import KVCache
from connector.worker.sequence import Sequence
from mempool import InsertResult
from mempool.transfer.agent import TransferAgent


class Engine(Protocol):
    """The scheduler as a hook sees it."""

    @property
    def kv(self) -> KVCache: ...

    def enqueue(self, seq: Sequence) -> None:
        """Queue a request for admission (after a hook's work before prefill)."""

    def join_prefilled(self, seq: Sequence) -> None:
        """A request whose prompt KV and first token are in place joins the running batch."""

    def retire(self, seq: Sequence, free: list[int], pinned: InsertResult | None = None) -> None:
        """Free `free` and what the request pins, unpin `pinned`, tell the client it ended."""


class RequestHooks:
    """A colocated instance: the scheduler's own path, nothing taken over."""

    def on_submit(self, seq: Sequence, extras: dict[str, Any], engine: Engine) -> bool:
        """Before `seq` is queued: True when the hook took it (it hands it back through
        `engine`); BadRequest when `extras` ask for what this instance cannot do."""
        return False

    def on_finish(self, seq: Sequence, cache: bool, engine: Engine) -> bool:
        """Before a finished request's KV becomes cache (`cache`: caching is on): True when
        the hook took it (it retires it through `engine`)."""
        return False

    async def start(self) -> None:
        """Before the first request."""

    async def close(self) -> None:
        """After the last request."""

    def info(self) -> dict[str, Any] | None:
        """What /get_server_info reports under `disaggregation`."""
        return None

    def server_info(self) -> dict[str, Any]:
        """Top-level /get_server_info entries about pulls of remote prefixes (`memserve`,
        `pull`): this instance neither pulls nor serves pulls."""
        return {"memserve": {"kv_pull": False, "serves_pulls": False}, "pull": no_pulls()}


def agent_address(agent: TransferAgent) -> dict[str, Any]:
    """Where peers reach this instance's MemPool agent (`memserve.agent`)."""
    return {"instance_id": agent.instance_id, "host": agent.host, "port": agent.port}


def no_pulls() -> dict[str, Any]:
    """The `pull` entry of an instance that does not pull."""
    pulls = dict.fromkeys(("pulls", "pulled_tokens", "failures", "refused_slower"), 0)
    return {**pulls, "modelled_s": 0.0}


class ChainedHooks(RequestHooks):
    """Several deployments' hooks on one instance (a PD prefill that also pulls prefixes):
    each point asks them in order until one takes the request; they start in order and
    close in reverse, and what they report is merged (a later one's entries win)."""

    def __init__(self, hooks: list[RequestHooks]) -> None:
        if not hooks:
            raise ValueError("chained hooks need at least one")
        self.hooks = hooks

    def on_submit(self, seq: Sequence, extras: dict[str, Any], engine: Engine) -> bool:
        return any(h.on_submit(seq, extras, engine) for h in self.hooks)

    def on_finish(self, seq: Sequence, cache: bool, engine: Engine) -> bool:
        return any(h.on_finish(seq, cache, engine) for h in self.hooks)

    async def start(self) -> None:
        started: list[RequestHooks] = []
        try:
            for hooks in self.hooks:
                await hooks.start()
                started.append(hooks)
        except BaseException:
            for hooks in reversed(started):
                await hooks.close()
            raise

    async def close(self) -> None:
        for hooks in reversed(self.hooks):
            await hooks.close()

    def info(self) -> dict[str, Any] | None:
        return next((i for h in self.hooks if (i := h.info()) is not None), None)

    def server_info(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for hooks in self.hooks:
            merged.update(hooks.server_info())
        return merged

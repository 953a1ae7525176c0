"""Agents on 127.0.0.1 sharing one in-process membership, closed (and checked) afterwards."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from mempool import MemPool
from mempool.transfer.agent import TransferAgent
from mempool.transfer.membership import ClusterManager, InProcessCluster

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    """asyncio.run with a ceiling: a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def agents(
    *pools: MemPool,
    membership: ClusterManager | None = None,
    options: list[dict[str, Any]] | None = None,
    **common: Any,
) -> AsyncIterator[list[TransferAgent]]:
    cluster = membership or InProcessCluster(ttl_s=2.0, heartbeat_s=0.5)
    common.setdefault("timeout_s", 2.0)
    started: list[TransferAgent] = []
    try:
        for i, pool in enumerate(pools):
            extra = options[i] if options else {}
            kwargs = {"membership": cluster, **common, **extra}
            agent = TransferAgent(pool, **kwargs)
            await agent.start()
            started.append(agent)
        yield started
    finally:
        for agent in started:
            await agent.close()
        if membership is None:
            await cluster.close()

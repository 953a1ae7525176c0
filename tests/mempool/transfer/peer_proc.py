"""A MemPool instance in its own process, for fault tests that kill or stop it.

    python -m tests.mempool.transfer.peer_proc --instance 2 --role receiver [--redis URL]
    python -m tests.mempool.transfer.peer_proc --instance 1 --role sender --target 2 \\
        --target-port P [--tokens N] [--redis URL]

Prints one JSON line when ready ({"port": control port} for a receiver; {"allocated":
blocks the receiver allocated} for a sender that has prepared a transfer and sent its first
layer) and then waits to be killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from mempool import KVBlockSpec, MemPool
from mempool.transfer.agent import TransferAgent
from mempool.transfer.base import PeerInfo
from mempool.transfer.membership import ClusterManager, RedisCluster

SPEC = KVBlockSpec(layers=4, kv_heads=8, head_dim=64, dtype="float16", page_size=16)
TTL_S, HEARTBEAT_S = 1.5, 0.25  # six beats per TTL: robust to a loaded machine


def tokens(n: int) -> list[int]:
    return [(i * 37) % 30_000 for i in range(n)]


def say(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> None:
    pool = MemPool(args.instance, SPEC, host_blocks=args.blocks)
    membership: ClusterManager | None = None
    if args.redis:
        membership = RedisCluster(args.redis, ttl_s=TTL_S, heartbeat_s=HEARTBEAT_S)
    agent = TransferAgent(pool, membership=membership, secret=args.secret, timeout_s=2.0)
    await agent.start()
    if args.role == "receiver":
        say(port=agent.port)
    else:
        if not args.redis:
            await agent.add_peer(PeerInfo(args.target, "127.0.0.1", args.target_port))
        src = sorted(pool.alloc_blocks(-(-args.tokens // SPEC.page_size)))
        stream = await agent.open_stream(args.target, src, tokens=tokens(args.tokens))
        await stream.send_layers(0, 1)
        say(allocated=len(stream.dst_addrs) - stream.cached_pages)
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--instance", type=int, required=True)
    parser.add_argument("--role", choices=["receiver", "sender"], required=True)
    parser.add_argument("--redis")
    parser.add_argument("--secret")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--target", type=int, default=0)
    parser.add_argument("--target-port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=64)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(parser.parse_args()))

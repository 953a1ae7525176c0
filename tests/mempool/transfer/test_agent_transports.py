"""The control plane drives any DataTransport: RdmaTransport (on the in-memory verbs double,
no device exists here) trades its queue-pair offers over the agent's control connection, and
push, insert and pull move intact bytes through it."""

from __future__ import annotations

import pytest

from mempool import KVBlockSpec, MemPool
from mempool.transfer.base import TransferFailed
from mempool.transfer.rdma import RdmaTransport
from tests.mempool.transfer.verbs_double import Fabric

from .agents import agents, run
from .kv import alloc, digest

SPEC = KVBlockSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16", page_size=4)


def test_rdma_queue_pairs_are_traded_over_the_control_plane() -> None:
    fabric = Fabric()
    a = MemPool(1, SPEC, host_blocks=64, layout="discrete")
    b = MemPool(2, SPEC, host_blocks=64)
    tokens = list(range(100, 122))

    async def main() -> None:
        ra = RdmaTransport(a, verbs=fabric.host(device="mlx5_0"))
        rb = RdmaTransport(b, verbs=fabric.host(device="mlx5_1"))
        opts = [{"transport": ra}, {"transport": rb}]
        async with agents(a, b, options=opts) as (ta, _):
            assert ra.exchange == ta._exchange  # the agent supplied the offer channel
            src = alloc(a, 6 * a.blocks_per_page)
            pushed = await ta.transfer_with_insert(2, tokens, src)
            assert digest(b, pushed.dst_addrs, range(22), (0, 2)) == digest(
                a, src, range(22), (0, 2)
            )
            assert b.match(tokens).num_tokens == 20 and ra.calls > 0
            c = MemPool(3, SPEC, host_blocks=64)
            async with agents(c, membership=ta.membership, transport="tcp") as (tc,):
                with pytest.raises(
                    TransferFailed, match=r"offers no 'tcp' data endpoint \(it offers rdma\)"
                ):
                    await tc.pull(2, tokens)  # a TCP-only instance cannot read from b
            d = MemPool(4, SPEC, host_blocks=64, layout="discrete")
            rd = RdmaTransport(d, verbs=fabric.host(device="mlx5_2"))
            async with agents(d, membership=ta.membership, transport=rd) as (td,):
                pulled = await td.pull(2, tokens)  # RDMA READ of b's cached pages
                assert (pulled.num_tokens, pulled.pages_pulled) == (20, 5)
                assert digest(d, pulled.addrs, range(20), (0, 2)) == digest(
                    a, src, range(20), (0, 2)
                )
            b.free_mem(pushed.dst_addrs[5:])
            a.free_mem(src)

    run(main())

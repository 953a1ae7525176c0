"""MooncakeTransport for real: two MemPools, two Mooncake engines, TCP over loopback.

Mooncake's listeners bind every interface, so each scenario runs in a spawned worker process
that first moved into a private network namespace whose only interface is loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from mempool import KVBlockSpec, Layout, MemPool, MemType
from mempool.transfer.base import PeerInfo, Segment, TransferFailed
from mempool.transfer.mooncake import (
    MooncakeConfig,
    MooncakeTransport,
    MooncakeUnavailable,
    enter_private_network,
    network_namespace,
)

SPEC = KVBlockSpec(layers=4, kv_heads=2, head_dim=8, dtype="float16", page_size=16)
HOST = int(MemType.HOST)
_isolation_error: str | None = None


def _isolate() -> None:
    """Worker initializer: remember why isolation failed instead of breaking the pool."""
    global _isolation_error
    try:
        enter_private_network()
    except OSError as exc:
        _isolation_error = str(exc)


def _probe() -> tuple[str | None, str | None, int]:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return _isolation_error, f"mooncake is not installed: {exc}", network_namespace()
    return _isolation_error, None, network_namespace()


@pytest.fixture(scope="module")
def isolated() -> Iterator[Callable[..., Any]]:
    """Run a scenario in a worker inside a private loopback-only network namespace."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=_isolate) as pool:
        isolation, missing, netns = pool.submit(_probe).result(timeout=120)
        if missing:
            pytest.skip(missing)
        if isolation:
            pytest.skip(f"Mooncake binds every interface and {isolation}: not run here")
        assert netns != network_namespace(), "the worker shares our network namespace"

        def run(fn: Callable[..., Any], *args: Any) -> Any:
            return pool.submit(fn, *args).result(timeout=300)

        yield run


# ------------------------------------------------------------------ scenarios (in the worker)


class _Pair:
    def __init__(self, layout: Layout, merge: bool = True, blocks: int = 256) -> None:
        self.pools = [MemPool(i, SPEC, host_blocks=blocks, layout=layout) for i in (1, 2)]
        cfg = MooncakeConfig(merge=merge)
        self.transports = [MooncakeTransport(p, cfg) for p in self.pools]
        self.infos = []
        for pool, t in zip(self.pools, self.transports, strict=True):
            endpoint = asyncio.run(t.start())
            self.infos.append(
                PeerInfo(pool.instance_id, "127.0.0.1", 0, t.regions, {"mooncake": endpoint})
            )

    def close(self) -> None:
        for t, p in zip(self.transports, self.pools, strict=True):
            asyncio.run(t.close())
            p.close()


def _segments(
    src: MemPool, src_addrs: list[int], dst: MemPool, dst_addrs: list[int]
) -> list[Segment]:
    out = []
    for s, d in zip(src_addrs, dst_addrs, strict=True):
        st, so = src.offset_of(s)
        dt, do = dst.offset_of(d)
        out.append(Segment(int(st), so, int(dt), do, src.block_size))
    return out


def _fill(pool: MemPool, addrs: list[int], seed: int) -> str:
    rng = random.Random(seed)
    for addr in addrs:
        pool.write_block(addr, rng.randbytes(pool.block_size))
    return _digest(pool, addrs)


def _digest(pool: MemPool, addrs: list[int]) -> str:
    h = hashlib.sha256()
    for addr in addrs:
        h.update(pool.read_block(addr))
    return h.hexdigest()


def _write_and_read() -> dict[str, Any]:
    p = _Pair(Layout.DISCRETE, merge=False)
    a, b = p.pools
    try:
        src = a.alloc_blocks(48)
        dst = b.alloc_blocks(48)
        random.Random(1).shuffle(dst)
        sent = _fill(a, src, seed=2)
        wrote = asyncio.run(p.transports[0].write(p.infos[1], _segments(a, src, b, dst)))
        landed = _digest(b, dst)
        back = b.alloc_blocks(48)
        origin = _fill(b, back, seed=3)
        local = a.alloc_blocks(48)
        read = asyncio.run(p.transports[0].read(p.infos[1], _segments(b, back, a, local)))
        return {
            "sent": sent,
            "landed": landed,
            "wrote": wrote,
            "origin": origin,
            "pulled": _digest(a, local),
            "read": read,
            "calls": p.transports[0].calls,
            "block": a.block_size,
        }
    finally:
        p.close()


def _merged_calls() -> dict[str, int]:
    page = 2 * SPEC.layers
    out = {}
    for merge in (True, False):
        p = _Pair(Layout.DISCRETE, merge=merge)
        a, b = p.pools
        try:
            src, dst = a.alloc_blocks(4 * page), b.alloc_blocks(4 * page)
            sent = _fill(a, src, seed=4)
            asyncio.run(p.transports[0].write(p.infos[1], _segments(a, src, b, dst)))
            assert _digest(b, dst) == sent
            out[str(merge)] = p.transports[0].calls
        finally:
            p.close()
    return out


def _big_batch() -> dict[str, Any]:
    """More entries than Mooncake's TCP transport takes in one batch (about 2,048)."""
    p = _Pair(Layout.DISCRETE, merge=False, blocks=5000)
    a, b = p.pools
    try:
        src, dst = a.alloc_blocks(5000), b.alloc_blocks(5000)
        sent = _fill(a, src, seed=5)
        asyncio.run(p.transports[0].write(p.infos[1], _segments(a, src, b, dst)))
        return {"sent": sent, "landed": _digest(b, dst), "calls": p.transports[0].calls}
    finally:
        p.close()


def _errors() -> dict[str, str]:
    p = _Pair(Layout.AGGREGATED)
    a, b = p.pools
    out: dict[str, str] = {}
    try:
        src, dst = a.alloc_blocks(2), b.alloc_blocks(2)
        segs = _segments(a, src, b, dst)
        asyncio.run(p.transports[0].write(p.infos[1], segs))
        # The peer's engine has a region we do not know about: it refuses the addresses.
        info = p.infos[1]
        bogus = {
            "segment": info.endpoints["mooncake"]["segment"],
            "regions": [{"mem_type": HOST, "base": 4096, "length": 1 << 30}],
        }
        stale = PeerInfo(2, "127.0.0.1", 0, (), {"mooncake": bogus})
        out["refused"] = _failure(p.transports[0].write(stale, segs))
        # Past the end of the peer's arena: refused before the engine is asked.
        length = b.region(MemType.HOST).nbytes
        out["bounds"] = _failure(
            p.transports[0].write(info, [Segment(HOST, 0, HOST, length - 8, 64)])
        )
        # The peer goes away.
        asyncio.run(p.transports[1].close())
        import gc

        gc.collect()
        out["gone"] = _failure(p.transports[0].write(info, segs))
        nowhere = PeerInfo(3, "127.0.0.1", 0, (), {"mooncake": {**bogus, "segment": "127.0.0.1:1"}})
        out["nowhere"] = _failure(p.transports[0].read(nowhere, segs))
        out["no_segment"] = _failure(p.transports[0].write(PeerInfo(4, "h", 0), segs))
    finally:
        p.close()
    return out


def _failure(coro: Any) -> str:
    try:
        asyncio.run(coro)
    except TransferFailed as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------------ tests


def test_write_and_read_move_bytes_intact(isolated: Callable[..., Any]) -> None:
    r = isolated(_write_and_read)
    assert r["landed"] == r["sent"]
    assert r["pulled"] == r["origin"]
    assert r["wrote"] == r["read"] == 48 * r["block"]
    assert r["calls"] == 96  # merge off: one batch entry per block, both ways


def test_contiguous_blocks_merge_into_fewer_entries(isolated: Callable[..., Any]) -> None:
    calls = isolated(_merged_calls)
    assert calls == {"True": 1, "False": 4 * 2 * SPEC.layers}


def test_requests_larger_than_one_engine_batch(isolated: Callable[..., Any]) -> None:
    r = isolated(_big_batch)
    assert r["landed"] == r["sent"] and r["calls"] == 5000


def test_failures_raise_transfer_failed_naming_the_peer(isolated: Callable[..., Any]) -> None:
    out = isolated(_errors)
    assert "instance 2" in out["refused"] and "return code -1" in out["refused"]
    assert "runs past" in out["bounds"] and "instance 2" in out["bounds"]
    assert "instance 2" in out["gone"] and "failed" in out["gone"]
    assert "instance 3" in out["nowhere"] and "127.0.0.1:1" in out["nowhere"]
    assert "publishes no segment" in out["no_segment"]


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_mooncake(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("mooncake"):
            raise ImportError("No module named 'mooncake'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mooncake)
    pool = MemPool(1, SPEC, host_blocks=4)
    try:
        with pytest.raises(MooncakeUnavailable, match="pip install mooncake-transfer-engine"):
            MooncakeTransport(pool)
    finally:
        pool.close()

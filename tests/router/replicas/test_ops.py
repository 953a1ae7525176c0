"""Replica messages and replicated trees, without Redis: encoding, dedupe, the outbox, and
that replaying one replica's operations (or loading its snapshot) rebuilds its holdings."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.replicas.ops import (
    ADD_WORKER,
    LOAD,
    RECORD,
    VERSION,
    Dedupe,
    Op,
    Outbox,
    Snapshot,
    decode_op,
    decode_snapshot,
    encode,
    pack_tokens,
    unpack_tokens,
)
from router.replicas.trees import ReplicatedTrees
from router.trees import Tier
from router.workers import WorkerType

A, B = "http://127.0.0.1:1001", "http://127.0.0.1:1002"
C = WorkerType.COLOCATED


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def trees_with_outbox(maxsize: int = 10_000) -> tuple[ReplicatedTrees, Outbox]:
    trees = ReplicatedTrees(page_size=4)
    trees.outbox = Outbox("a", 7, maxsize)
    return trees, trees.outbox


def replay(outbox: Outbox, into: ReplicatedTrees) -> int:
    ops = outbox.take(1 << 20)
    for op in ops:  # through the wire format, as a reader gets them
        assert into.apply(decode_op(encode(op)))
    return len(ops)


def test_tokens_are_uint32_little_endian() -> None:
    assert pack_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"
    assert list(unpack_tokens(pack_tokens([0, 7, 2**32 - 1]))) == [0, 7, 2**32 - 1]
    with pytest.raises(ValueError):
        unpack_tokens(b"\x00\x01\x02")


def test_op_and_snapshot_round_trip() -> None:
    op = Op(VERSION, "r1", 5, 9, RECORD, ts=1.5, url=A, tokens=pack_tokens([1, 2, 3, 4]))
    assert decode_op(encode(op)) == op
    assert decode_op(encode(Op(VERSION, "r1", 5, 10, ADD_WORKER, url=B))).bootstrap_port is None
    load = Op(VERSION, "r1", 5, 11, LOAD, loads={A: [2, 900], B: [0, 0]})
    assert decode_op(encode(load)).loads == {A: [2, 900], B: [0, 0]}
    snap = Snapshot(VERSION, "r1", "1-0", 2.0)
    assert decode_snapshot(encode(snap)) == snap
    with pytest.raises(msgspec.DecodeError):
        decode_op(b"\x93garbage")


def test_dedupe_skips_repeats_per_incarnation() -> None:
    d = Dedupe()
    first = Op(VERSION, "r1", 1, 1, RECORD)
    assert d.fresh(first)
    assert not d.fresh(first)  # a batch published twice
    assert d.fresh(Op(VERSION, "r1", 1, 2, RECORD))
    assert d.fresh(Op(VERSION, "r1", 2, 1, RECORD))  # the same replica, restarted
    assert d.fresh(Op(VERSION, "r2", 1, 1, RECORD))


def test_a_full_outbox_drops_the_newest_and_counts() -> None:
    async def run() -> None:
        box = Outbox("a", 1, maxsize=2)
        assert box.emit(RECORD) is not None
        assert box.emit(RECORD) is not None
        assert box.emit(RECORD) is None
        assert box.dropped == 1
        assert [op.seq for op in box.take(10)] == [1, 2]

    asyncio.run(run())


def test_changes_are_published_and_applied_elsewhere_without_echo() -> None:
    a, box = trees_with_outbox()
    a.record(C, A, tokens(10))  # two whole pages (8 tokens) published
    a.record(C, B, tokens(3))  # less than a page: nothing to hold, nothing published
    a.record(C, B, tokens(8, 100), Tier.HOST)
    a.feedback(C, A, tokens(10), predicted=8, reported=4)  # a correction: a drop
    b = ReplicatedTrees(page_size=4)
    b.outbox = Outbox("b", 8)
    assert replay(box, b) == 3
    assert b.outbox.queue.empty()  # applied, not re-published
    # (the dropped page stays A's home: where that prefix lived)
    expected = {"colocated": {A: 1, f"{A}#home": 2, f"{B}#host": 2}}
    assert b.holder_pages() == a.holder_pages() == expected
    a.forget(B)
    a.clear()
    replay(box, b)
    assert b.holder_pages() == a.holder_pages() == {}


def test_a_malformed_op_is_refused() -> None:
    b = ReplicatedTrees(page_size=4)
    assert not b.apply(Op(VERSION, "a", 1, 1, RECORD, url=A, tokens=b"\x00"))
    assert not b.apply(Op(VERSION, "a", 1, 2, RECORD, type="nope", url=A))
    assert not b.apply(Op(VERSION, "a", 1, 3, "compact"))


ops = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "drop", "forget"]),
        st.sampled_from([A, B]),
        st.sampled_from(list(Tier)),
        st.lists(st.integers(0, 3), min_size=4, max_size=24),
        st.integers(0, 24),
    ),
    max_size=40,
)


def run(trees: ReplicatedTrees, step: tuple[str, str, Tier, list[int], int]) -> None:
    """One step of a generated script: record, drop (one tier or all) or forget."""
    kind, url, tier, toks, keep = step
    if kind == "record":
        trees.record(C, url, toks, tier)
    elif kind == "drop":
        trees.drop(C, url, toks, keep, tier if keep % 2 else None)
    else:
        trees.forget(url)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_replay_and_snapshot_rebuild_the_same_holdings(
    script: list[tuple[str, str, Tier, list[int], int]],
) -> None:
    a, box = trees_with_outbox()
    for step in script:
        run(a, step)
    replica = ReplicatedTrees(page_size=4)
    replay(box, replica)
    assert replica.holder_pages() == a.holder_pages()
    late = ReplicatedTrees(page_size=4)
    late.load(decode_snapshot(encode(Snapshot(VERSION, "a", "0", 0.0, a.snapshot()))).entries)
    assert late.holder_pages() == a.holder_pages()


@settings(max_examples=100, deadline=None)
@given(ops, ops)
def test_a_snapshot_taken_while_the_trees_change_plus_the_stream_after_it_converges(
    before: list[tuple[str, str, Tier, list[int], int]],
    during: list[tuple[str, str, Tier, list[int], int]],
) -> None:
    """The snapshot is walked in parts with requests running between them: changes made
    meanwhile may or may not be in it, and replaying them after loading it converges."""
    a, box = trees_with_outbox()
    for step in before:
        run(a, step)
    box.take(1 << 20)  # the stream up to the cursor
    entries = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("router.replicas.trees.SNAPSHOT_PART", 1)  # a change after every node
        pending = list(during)
        for part in a._snapshot_parts():
            entries.extend(part)
            if pending:
                run(a, pending.pop(0))
        for step in pending:
            run(a, step)
    late = ReplicatedTrees(page_size=4)
    late.load(entries)
    replay(box, late)  # what came after the cursor
    assert late.holder_pages() == a.holder_pages()


def test_the_async_snapshot_is_the_snapshot() -> None:
    a, _ = trees_with_outbox()
    for i in range(50):
        a.record(C, (A, B)[i % 2], tokens(8 + 4 * (i % 7), start=100 * (i % 5)))
    assert asyncio.run(a.snapshot_async()) == a.snapshot()

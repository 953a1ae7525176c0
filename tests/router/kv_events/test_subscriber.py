"""Every replica subscribes to every worker's KV events: where a worker's events are found,
and the sequence numbers kept whole over a late start, a lost batch and a restart, with our
worker's real publisher (and its replay socket) on real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import zmq

from router.kv_events.listener import KVEventApplier
from router.kv_events.subscriber import (
    EventSource,
    KVEventSubscriber,
    connectable,
    unfollowable_reason,
)
from router.trees import PromptTrees
from router.workers import BreakerConfig, WorkerRegistry, WorkerType
from shared.kv_events import KVEventPublisher, KVEventsConfig, publisher_binds

URL = "http://10.0.0.7:30001"
PAGE = 4


def test_the_source_is_where_the_worker_binds_seen_from_the_router() -> None:
    def source(config: object) -> EventSource | None:
        return EventSource.from_server_info(URL, {"kv_events_config": config})

    bound = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    # SGLang reports its server args' kv_events_config as the JSON string it was given
    assert source(json.dumps(bound)) == EventSource("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert source({"publisher": "zmq"}) == EventSource("tcp://10.0.0.7:5557")  # SGLang's default
    assert source({"publisher": "zmq", "endpoint": "ipc:///run/w1.sock"}) == EventSource(
        "ipc:///run/w1.sock"
    )
    # a concrete address: the worker connects to one listener (a --kv-events-bind router)
    assert source({"publisher": "zmq", "endpoint": "tcp://10.0.0.1:5557"}) is None
    # ... unless it binds it (SGLang's "bind": true): followed as given, replay too (SGLang
    # binds its replay socket whatever the host)
    for host in ("127.0.0.1", "10.0.0.7", "w7.example"):
        loopback = {"publisher": "zmq", "endpoint": f"tcp://{host}:5557", "bind": True}
        assert source(json.dumps(loopback)) == EventSource(f"tcp://{host}:5557")
        loopback["replay_endpoint"] = f"tcp://{host}:5558"
        assert source(loopback) == EventSource(f"tcp://{host}:5557", f"tcp://{host}:5558")
    # a wildcard with "bind": false connects; 0.0.0.0 binds (SGLang's rule)
    assert source({"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": False}) is None
    assert source({"publisher": "zmq", "endpoint": "tcp://0.0.0.0:5557"}) == EventSource(
        "tcp://10.0.0.7:5557"
    )
    # a wildcard publisher with a concrete replay address: the replay is reached there
    assert source(
        {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://10.1.1.1:9"}
    ) == EventSource("tcp://10.0.0.7:5557", "tcp://10.1.1.1:9")
    assert source({"publisher": "null"}) is None
    assert source("not json") is None
    assert source(None) is None
    assert EventSource.from_server_info(URL, None) is None
    assert connectable("tcp://0.0.0.0:7000", "::1") == "tcp://[::1]:7000"
    assert connectable("tcp://[::]:7000", "w.example") == "tcp://w.example:7000"
    assert connectable("inproc://x", "h") is None
    assert connectable("tcp://127.0.0.1:7000", "h", True) == "tcp://127.0.0.1:7000"
    assert connectable("tcp://127.0.0.1:7000", "h") is None
    assert connectable("ipc:///run/w.sock", "h", False) is None
    assert connectable("tcp://*:nope", "h") is None


def test_why_a_worker_cannot_be_followed_is_said() -> None:
    def reason(config: object) -> str:
        return unfollowable_reason({"kv_events_config": config})

    assert "publishes no KV events" in reason(None)
    assert "publishes no KV events" in reason({"publisher": "null"})
    concrete = reason({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"})
    assert 'without "bind": true' in concrete and "tcp://127.0.0.1:5557" in concrete
    assert '"bind": false' in reason({"publisher": "zmq", "endpoint": "tcp://*:1", "bind": False})


class Setup:
    """A registry with one worker, its trees, the applier and a subscriber."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry(BreakerConfig())
        self.registry.add(URL)
        self.trees = PromptTrees(page_size=PAGE)
        self.subscriber = KVEventSubscriber(KVEventApplier(self.trees, self.registry))

    def held(self, tokens: list[int]) -> int:
        return self.trees.match(WorkerType.COLOCATED, tokens).held.get(URL, 0)

    @property
    def stats(self) -> dict[str, int]:
        info = self.subscriber.info()
        return {k: v for k, v in info.items() if isinstance(v, int)}


def publisher(tmp_path: Path, replay: bool = True, name: str = "w") -> KVEventPublisher:
    config = KVEventsConfig(
        publisher="zmq",
        endpoint=f"ipc://{tmp_path}/{name}.sock",
        replay_endpoint=f"ipc://{tmp_path}/{name}-replay.sock" if replay else None,
    )
    return KVEventPublisher(config, PAGE)


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(2 * PAGE)]  # two whole pages


def publish(pub: KVEventPublisher, i: int) -> None:
    pub.stored(prompt(i), 0, 2)
    pub.flush()


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def run(body: Callable[[Setup], Awaitable[None]]) -> None:
    async def main() -> None:
        setup = Setup()
        try:
            await body(setup)
        finally:
            await setup.subscriber.stop()

    asyncio.run(main())


def source_of(pub_dir: Path, replay: bool = True, name: str = "w") -> EventSource:
    info = {
        "kv_events_config": json.dumps(
            {
                "publisher": "zmq",
                "endpoint": f"ipc://{pub_dir}/{name}.sock",
                **({"replay_endpoint": f"ipc://{pub_dir}/{name}-replay.sock"} if replay else {}),
            }
        )
    }
    source = EventSource.from_server_info(URL, info)
    assert source is not None
    return source


async def subscribed(setup: Setup, pub: KVEventPublisher, source: EventSource) -> None:
    """Subscribe, then publish until the subscription carries batches (ZMQ's slow joiner:
    a PUB drops what it sends before the SUB's connection is up)."""
    setup.subscriber.follow(URL, source)
    marker = 900
    for _ in range(200):
        publish(pub, marker)
        await asyncio.sleep(0.02)
        if setup.held(prompt(marker)):
            return
    raise AssertionError("the subscription never carried a batch")


def test_a_late_subscriber_replays_what_the_worker_published_before_it(tmp_path: Path) -> None:
    async def body(setup: Setup) -> None:
        pub = publisher(tmp_path)
        try:
            for i in range(3):  # heard by nobody
                publish(pub, i)
            await subscribed(setup, pub, source_of(tmp_path))
            assert all(setup.held(prompt(i)) == 2 * PAGE for i in range(3))
            assert setup.stats["lost"] == 0 and setup.stats["replayed"] >= 3
        finally:
            pub.close()

    run(body)


def test_a_workers_whole_history_replaces_what_the_replica_believed(tmp_path: Path) -> None:
    """A late replica's snapshot can say a worker holds what it has since evicted; the
    worker's history from its first batch on is the truth."""

    async def body(setup: Setup) -> None:
        setup.trees.record(WorkerType.COLOCATED, URL, prompt(50))  # from a snapshot, say
        pub = publisher(tmp_path)
        try:
            publish(pub, 0)
            await subscribed(setup, pub, source_of(tmp_path))
            assert setup.held(prompt(0)) == 2 * PAGE
            assert setup.held(prompt(50)) == 0
        finally:
            pub.close()

    run(body)


def test_a_batch_lost_on_the_way_is_replayed(tmp_path: Path) -> None:
    async def body(setup: Setup) -> None:
        pub = publisher(tmp_path)
        try:
            await subscribed(setup, pub, source_of(tmp_path))
            gaps = setup.stats["gaps"]
            send = pub._pub.send_multipart
            pub._pub.send_multipart = lambda *a, **k: None  # type: ignore[method-assign]
            publish(pub, 1)  # buffered for replay, never sent
            pub._pub.send_multipart = send  # type: ignore[method-assign]
            publish(pub, 2)
            await until(lambda: setup.held(prompt(2)) > 0)
            assert setup.held(prompt(1)) == 2 * PAGE
            assert setup.stats["gaps"] == gaps + 1 and setup.stats["lost"] == 0
        finally:
            pub.close()

    run(body)


def test_without_a_replay_socket_a_gap_is_counted_and_the_feed_goes_on(tmp_path: Path) -> None:
    async def body(setup: Setup) -> None:
        pub = publisher(tmp_path, replay=False)
        try:
            await subscribed(setup, pub, source_of(tmp_path, replay=False))
            lost = setup.stats["lost"]
            send = pub._pub.send_multipart
            pub._pub.send_multipart = lambda *a, **k: None  # type: ignore[method-assign]
            publish(pub, 1)
            pub._pub.send_multipart = send  # type: ignore[method-assign]
            publish(pub, 2)
            await until(lambda: setup.held(prompt(2)) > 0)
            assert setup.held(prompt(1)) == 0
            assert setup.stats["lost"] == lost + 1
        finally:
            pub.close()

    run(body)


def test_a_restarted_worker_is_forgotten_then_followed_from_its_new_start(
    tmp_path: Path,
) -> None:
    async def body(setup: Setup) -> None:
        old = publisher(tmp_path)
        await subscribed(setup, old, source_of(tmp_path))
        for i in range(5):
            publish(old, i)
        await until(lambda: setup.held(prompt(4)) > 0)
        old.close()
        new = publisher(tmp_path)  # the same endpoint, numbering from 0, an empty cache
        try:
            for _ in range(200):  # the SUB reconnects on its own
                publish(new, 7)
                await asyncio.sleep(0.02)
                if setup.held(prompt(7)):
                    break
            assert setup.held(prompt(7)) == 2 * PAGE
            assert setup.held(prompt(3)) == 0  # the old process's cache is gone
            assert setup.stats["restarts"] == 1
        finally:
            new.close()

    run(body)


def test_a_restarted_worker_numbering_past_the_old_one_before_the_reconnect_is_told_apart(
    tmp_path: Path,
) -> None:
    """The new process's first live batch the subscription sees comes after the old one's
    last number (the SUB reconnected late): a gap, whose replay from the last batch applied
    finds a different batch there, so it is a restart, not the old numbering going on."""

    async def body(setup: Setup) -> None:
        old = publisher(tmp_path)
        await subscribed(setup, old, source_of(tmp_path))
        for i in range(5):
            publish(old, i)
        await until(lambda: setup.held(prompt(4)) > 0)
        past = old._seq + 2  # the new process numbers this far before one reaches the SUB
        old.close()
        new = publisher(tmp_path)
        try:
            send = new._pub.send_multipart
            new._pub.send_multipart = lambda *a, **k: None  # type: ignore[method-assign]
            while new._seq < past:
                publish(new, 7)
            new._pub.send_multipart = send  # type: ignore[method-assign]
            for _ in range(200):  # the SUB reconnects on its own
                publish(new, 7)
                await asyncio.sleep(0.02)
                if setup.held(prompt(7)):
                    break
            assert setup.held(prompt(7)) == 2 * PAGE
            assert setup.held(prompt(3)) == 0  # the old process's cache is gone
            assert setup.stats["restarts"] == 1
        finally:
            new.close()

    run(body)


def test_the_replay_socket_answers_while_the_engine_is_idle(tmp_path: Path) -> None:
    """Replays are served by the publisher's own thread, not on the next engine step."""
    pub = publisher(tmp_path)
    try:
        for i in range(3):
            publish(pub, i)
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(f"ipc://{tmp_path}/w-replay.sock")
        sock.send_multipart((b"", (1).to_bytes(8, "big")))
        seqs = []
        while True:
            assert sock.poll(2000), "no replay answer within 2 s"
            _, seq, payload = sock.recv_multipart()
            seqs.append(int.from_bytes(seq, "big", signed=True))
            if seqs[-1] < 0:
                assert payload == b""
                break
        assert seqs == [1, 2, -1]
        sock.close(linger=0)
    finally:
        pub.close()


def test_the_worker_reads_sglangs_bind_key() -> None:
    """SGLang 0.5.23's `bind`: the worker accepts it (true/false) and refuses anything else;
    without it, the same rule as SGLang's publisher decides."""
    config = KVEventsConfig.parse(
        '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:1", "bind": true}'
    )
    assert config.bind is True
    assert KVEventsConfig.parse('{"publisher": "zmq"}').bind is None
    with pytest.raises(ValueError, match="bind must be true or false"):
        KVEventsConfig.parse('{"publisher": "zmq", "bind": "yes"}')
    assert publisher_binds("tcp://0.0.0.0:1") and publisher_binds("tcp://*:1")
    assert publisher_binds("ipc:///run/w.sock") and not publisher_binds("tcp://10.0.0.1:1")
    assert publisher_binds("tcp://10.0.0.1:1", True) and not publisher_binds("tcp://*:1", False)

"""Every router replica subscribes to every worker's KV events (--kv-events-subscribe).

SGLang's publisher binds its PUB socket (`"endpoint": "tcp://*:5557"`, or a concrete address
with `"bind": true`) and fans each batch out to every subscriber, so replicas do not compete
for a worker's events: each one SUB-connects to each worker, at the endpoint the worker
reports in /get_server_info (`kv_events_config`: a wildcard host becomes the worker's host, a
concrete host and an `ipc://` path are used as given). One socket a worker tells whose
events a batch holds (the topic is not needed) and lets the sequence numbers be checked:

- a batch after a gap (a slow start, a full queue) asks the worker's replay socket for
  what was missed, from the buffer it keeps, before going on: from the last batch applied,
  which, if it is not the one the worker holds under that number, tells a restarted worker
  that numbered past the old one before the subscription reconnected;
- a live sequence number that does not grow means the worker restarted (its numbering
  starts again at 0 with an empty cache): the replica forgets what it held, then replays
  from 0 whatever the new process already published;
- batches seen twice (live ones the replay already gave) are skipped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from router.kv_events.listener import KVEventApplier
from shared.kv_events import KVEventBatch, publisher_binds

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
CHECK_INTERVAL_S = 1.0  # a feed quiet this long asks the worker whether it missed anything
RECENT_BATCHES = 4096  # fingerprints kept to tell a copy from a restarted worker's batch
WILDCARD_HOSTS = {"*", "0.0.0.0", "[::]", "::"}


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one worker publishes its KV events (and answers replays)."""

    endpoint: str
    replay: str | None = None

    @classmethod
    def from_server_info(cls, worker_url: str, info: object) -> EventSource | None:
        """The worker's `kv_events_config` (SGLang's JSON string, or an object) as addresses
        a subscriber can connect to; None when it publishes nothing one can subscribe to."""
        raw = events_config(info)
        if raw is None:
            return None
        endpoint = raw.get("endpoint", "tcp://*:5557")
        bind = raw.get("bind")
        replay = raw.get("replay_endpoint")
        host = urlsplit(worker_url).hostname or "127.0.0.1"
        source = connectable(endpoint, host, bind if isinstance(bind, bool) else None)
        if source is None:
            return None
        # SGLang binds its replay socket whatever its host (parse_tcp_port: "the replay ROUTER
        # binds any host spelling")
        return cls(source, connectable(replay, host, True) if isinstance(replay, str) else None)


def events_config(info: object) -> dict[str, object] | None:
    """A worker's /get_server_info `kv_events_config` (SGLang reports its server args: the
    JSON string it was given) when it publishes over ZMQ, else None."""
    raw = info.get("kv_events_config") if isinstance(info, dict) else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    if not isinstance(raw, dict) or raw.get("publisher") != "zmq":
        return None
    return raw


def connectable(endpoint: object, worker_host: str, bind: bool | None = None) -> str | None:
    """A bound endpoint as a peer reaches it: a wildcard host becomes the worker's host; a
    concrete host (`tcp://127.0.0.1:5557` with `"bind": true`, a hostname, an IP) and an
    `ipc://` path are followed as given. None for an endpoint the worker connects to (it
    pushes to one listener, a --kv-events-bind router: not ours) and for `inproc://`."""
    if not isinstance(endpoint, str) or not publisher_binds(endpoint, bind):
        return None
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    if host not in WILDCARD_HOSTS:
        return endpoint  # bound on that address: reached there
    if ":" in worker_host:
        worker_host = f"[{worker_host}]"
    return f"tcp://{worker_host}:{port}"


def unfollowable_reason(info: object) -> str:
    """Why a worker's KV events cannot be followed, for the log line that says so."""
    raw = events_config(info)
    if raw is None:
        return (
            "it publishes no KV events: give it --kv-events-config "
            '\'{"publisher":"zmq","endpoint":"tcp://*:PORT"}\''
        )
    endpoint = raw.get("endpoint", "tcp://*:5557")
    if raw.get("bind") is False:
        return f'its config says "bind": false: it connects to one listener at {endpoint}'
    if isinstance(endpoint, str) and endpoint.startswith("tcp://") and raw.get("bind") is None:
        return (
            f'its endpoint {endpoint} is a concrete address without "bind": true, so it '
            'connects to one listener there instead of binding it: add "bind": true to '
            "its --kv-events-config to publish on that address, or use tcp://*:PORT"
        )
    return f"its endpoint {endpoint!r} is not one a replica can connect to (tcp:// or ipc://)"


@dataclass(slots=True)
class FeedStats:
    batches: int = 0
    gaps: int = 0  # batches that came after missing ones
    replayed: int = 0  # batches recovered through replays
    lost: int = 0  # batches missed and not recovered (no replay socket, or not buffered)
    restarts: int = 0
    duplicates: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FeedStats.__dataclass_fields__}


@dataclass(slots=True)
class _Feed:
    """One worker's subscription."""

    url: str
    source: EventSource
    sock: zmq.asyncio.Socket
    task: asyncio.Task[None] | None = None
    applied_last: int = -1  # the last sequence number applied (live or replayed)
    # what the recent batches applied were (a fingerprint by sequence number): a live batch
    # numbered as one of them is a copy of it (the replay gave it first), or comes from a
    # new process of the worker
    recent: dict[int, int] = field(default_factory=dict)
    stats: FeedStats = field(default_factory=FeedStats)

    def reset(self) -> None:
        self.applied_last = -1
        self.recent.clear()


class KVEventSubscriber:
    """The replica's subscriptions, one per worker that publishes."""

    def __init__(self, applier: KVEventApplier) -> None:
        self.applier = applier
        self.feeds: dict[str, _Feed] = {}
        self._ctx = zmq.asyncio.Context.instance()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def follow(self, url: str, source: EventSource) -> None:
        """Subscribe to `url`'s events at `source` (again, if it moved)."""
        feed = self.feeds.get(url)
        if feed is not None:
            if feed.source == source:
                return
            self.unfollow(url)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(source.endpoint)
        feed = _Feed(url, source, sock)
        feed.task = asyncio.get_running_loop().create_task(self._run(feed))
        self.feeds[url] = feed
        log.info("subscribed to KV events of %s at %s", url, source.endpoint)

    def unfollow(self, url: str) -> None:
        feed = self.feeds.pop(url, None)
        if feed is None:
            return
        if feed.task is not None:
            feed.task.cancel()
        feed.sock.close(linger=0)

    def restart(self, url: str) -> None:
        """Follow `url` afresh: its next batch is taken as a first one (and whatever its
        buffer holds is replayed), as for a worker that may have restarted."""
        feed = self.feeds.get(url)
        if feed is not None:
            feed.reset()

    async def stop(self) -> None:
        tasks = [f.task for f in self.feeds.values() if f.task is not None]
        for url in list(self.feeds):
            self.unfollow(url)
        await asyncio.gather(*tasks, return_exceptions=True)

    def info(self) -> dict[str, object]:
        totals = FeedStats().as_dict()
        for feed in self.feeds.values():
            for name, count in feed.stats.as_dict().items():
                totals[name] += count
        return {
            "mode": "subscribe",
            "sources": {url: f.source.endpoint for url, f in self.feeds.items()},
            **totals,
        }

    # ----------------------------------------------------------------- one worker

    async def _run(self, feed: _Feed) -> None:
        first = True
        while True:
            try:
                if first:  # what the worker published before (a late replica)
                    first = False
                    await self._replay(feed, 0)
                elif not await feed.sock.poll(CHECK_INTERVAL_S * 1000):
                    await self._check(feed)
                else:
                    frames = await feed.sock.recv_multipart()
                    if len(frames) == 3 and len(frames[1]) == 8:
                        seq = int.from_bytes(frames[1], "big", signed=True)
                        await self._receive(feed, seq, frames[2])
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad batch or exchange must not end the subscription
                log.exception("KV events of %s: batch not applied", feed.url)
                await asyncio.sleep(CHECK_INTERVAL_S)

    async def _receive(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if seq <= feed.applied_last:
            if feed.recent.get(seq) == hash(payload):
                feed.stats.duplicates += 1
                return
            feed.stats.restarts += 1
            log.warning("KV events of %s numbered %d again: it restarted", feed.url, seq)
            self.applier.forget(feed.url)
            feed.reset()
        if seq > feed.applied_last + 1:
            feed.stats.gaps += 1
            if feed.applied_last < 0:
                await self._replay(feed, 0)
            else:  # from the last one applied: a new process numbering past it is told apart
                await self._check(feed)
            if seq <= feed.applied_last:
                return  # the replay brought it
        self._take(feed, seq, payload)

    async def _check(self, feed: _Feed) -> None:
        """A quiet feed: ask the worker for its batches from the last one applied. That
        same batch first means nothing was lost (any after it are applied now); anything
        else means a new process whose first batches went out before the subscription
        reconnected: the old one's pages are forgotten and the new one's history taken."""
        if feed.source.replay is None:
            return
        last = feed.applied_last
        batches = await self._fetch(feed, max(last, 0))
        if batches is None:  # no answer: the worker is down, or busy
            return
        known = feed.recent.get(last)
        if last >= 0 and known is not None:
            same = bool(batches) and batches[0][0] == last and hash(batches[0][1]) == known
            if not same:
                feed.stats.restarts += 1
                log.warning("KV events of %s: its publisher started again", feed.url)
                self.applier.forget(feed.url)
                feed.reset()
                await self._replay(feed, 0)
                return
        for seq, payload in batches:
            if seq > feed.applied_last:
                self._take(feed, seq, payload)
                feed.stats.replayed += 1

    def _take(self, feed: _Feed, seq: int, payload: bytes) -> None:
        """Apply one batch that follows what was applied (counting any batches between
        as lost for good)."""
        if seq > feed.applied_last + 1:
            missed = seq - feed.applied_last - 1
            feed.stats.lost += missed
            log.warning("KV events of %s: %d batches missed for good", feed.url, missed)
        feed.applied_last = seq
        feed.recent[seq] = hash(payload)
        if len(feed.recent) > 2 * RECENT_BATCHES:
            feed.recent = {s: h for s, h in feed.recent.items() if s > seq - RECENT_BATCHES}
        feed.stats.batches += 1
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            log.warning("undecodable KV event batch from %s", feed.url)
            return
        self.applier.apply(feed.url, batch)

    async def _replay(self, feed: _Feed, first: int) -> None:
        """Fetch batches `first`.. from the worker's replay socket and apply those not yet
        applied. A replay from 0 that starts at 0 is the worker's whole history: what the
        replica believed before (a snapshot's holdings, say) gives way to it."""
        batches = await self._fetch(feed, first) if feed.source.replay is not None else None
        if batches is None:
            return
        if first == 0 and batches and batches[0][0] == 0 and feed.applied_last < 0:
            self.applier.forget(feed.url)
        for seq, payload in batches:
            if seq > feed.applied_last:
                self._take(feed, seq, payload)
                feed.stats.replayed += 1

    async def _fetch(self, feed: _Feed, first: int) -> list[tuple[int, bytes]] | None:
        """One replay exchange with the worker's ROUTER socket: the batches from `first`
        on that it still buffers (None if it does not answer in time)."""
        assert feed.source.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(feed.source.replay)
        batches: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart((b"", first.to_bytes(8, "big", signed=True)))
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 3 or len(frames[1]) != 8:
                        continue
                    seq = int.from_bytes(frames[1], "big", signed=True)
                    if seq < 0:
                        return batches
                    batches.append((seq, frames[2]))
        except TimeoutError:
            log.debug("KV events of %s: replay from %d timed out", feed.url, first)
            return None
        finally:
            sock.close(linger=0)

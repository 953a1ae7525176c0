"""Workers' KV events into the prompt trees.

`listener`: one router binds a socket the workers push to (`--kv-events-bind`), and the
applier both feeds use; `subscriber`: every replica subscribes to every worker's publisher
(`--kv-events-subscribe`), with gaps filled from replay sockets.
"""

from router.kv_events.listener import KVEventApplier, KVEventListener
from router.kv_events.subscriber import (
    EventSource,
    FeedStats,
    KVEventSubscriber,
    connectable,
    unfollowable_reason,
)

__all__ = [
    "EventSource",
    "FeedStats",
    "KVEventApplier",
    "KVEventListener",
    "KVEventSubscriber",
    "connectable",
    "unfollowable_reason",
]

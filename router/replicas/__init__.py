"""Router replicas sharing state through Redis.

`ops` is what they tell each other (the message formats and the outbox), `trees` the prompt
trees that publish their changes and apply the others', `sync` the Redis side (the
Replicator: publisher, reader, snapshots, load).
"""

from router.replicas.sync import ReplicaConfig, ReplicaMetrics, Replicator, new_replica_id
from router.replicas.trees import ReplicatedTrees

__all__ = ["ReplicaConfig", "ReplicaMetrics", "ReplicatedTrees", "Replicator", "new_replica_id"]

"""MemPool's distributed side: moving KV blocks between instances (MemServe 4.3, 4.4).

`TransferAgent` is the API (transfer, transfer_with_insert, open_stream, pull, wait_received);
`DataTransport`s move bytes (TcpTransport, LocalTransport here; RdmaTransport and
MooncakeTransport in their own modules, imported on demand since they need native
libraries); membership says who is alive (InProcessCluster, RedisCluster).
"""

from mempool.transfer.agent import PullResult, TransferAgent, TransferResult, TransferStream
from mempool.transfer.auth import AuthenticationFailed
from mempool.transfer.base import (
    DataTransport,
    PeerInfo,
    Region,
    Segment,
    TransferFailed,
    merge_segments,
)
from mempool.transfer.local import LocalTransport
from mempool.transfer.membership import (
    ClusterManager,
    InProcessCluster,
    MembershipError,
    MembershipUnavailable,
    RedisCluster,
    UnknownPeer,
)
from mempool.transfer.plan import KVGeometry, check_compatible, plan_segments
from mempool.transfer.receiver import Received, TransferFlags
from mempool.transfer.tcp import TcpTransport

__all__ = [
    "AuthenticationFailed",
    "ClusterManager",
    "DataTransport",
    "InProcessCluster",
    "KVGeometry",
    "LocalTransport",
    "MembershipError",
    "MembershipUnavailable",
    "PeerInfo",
    "PullResult",
    "Received",
    "RedisCluster",
    "Region",
    "Segment",
    "TcpTransport",
    "TransferAgent",
    "TransferFailed",
    "TransferFlags",
    "TransferResult",
    "TransferStream",
    "UnknownPeer",
    "check_compatible",
    "merge_segments",
    "plan_segments",
]

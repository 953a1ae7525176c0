"""The backend's settings, read from `--hicache-storage-backend-extra-config` JSON.

SGLang hands the whole JSON object to the backend (`HiCacheStorageConfig.extra_config`); it
also holds SGLang's own keys (`backend_name`, `module_path`, `class_name`, `interface_v1`,
`hicache_storage_pass_prefix_keys`, ...). Ours all start with `mempool_`; an unknown `mempool_`
key is refused, so a typo fails at start instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PREFIX = "mempool_"


@dataclass(frozen=True)
class Peer:
    """A MemPool instance that receives this server's pages (a prefill server's backend)."""

    instance_id: int
    host: str
    port: int

    @classmethod
    def parse(cls, value: object) -> Peer:
        """`"ID@HOST:PORT"` or `{"instance_id": ID, "host": HOST, "port": PORT}`."""
        try:
            if isinstance(value, str):
                ident, _, where = value.partition("@")
                host, _, port = where.rpartition(":")
                if not ident or not host or not port:
                    raise ValueError
                peer = cls(int(ident), host, int(port))
            elif isinstance(value, dict):
                peer = cls(int(value["instance_id"]), str(value["host"]), int(value["port"]))
            else:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"mempool_writeback_peers: bad peer {value!r}; expected 'ID@HOST:PORT' or "
                '{"instance_id": ID, "host": HOST, "port": PORT}'
            ) from None
        _check_id("mempool_writeback_peers instance_id", peer.instance_id)
        _check_port("mempool_writeback_peers port", peer.port)
        return peer


@dataclass(frozen=True)
class BackendConfig:
    """What one server's backend runs with.

    `instance_id`: this server's MemPool instance id (unique in the cluster; TP rank r uses
    instance_id + r). `capacity_pages`: how many SGLang pages its pool holds (LRU beyond).
    `host`/`port`: where its transfer agent listens for pushed pages (port 0: any free port;
    TP rank r listens on port + r). `writeback_peers`: where a decode server pushes every page
    it stores (MemServe's PD-Caching-3). `page_size`: SGLang tokens per page, checked against
    the server's host pool when given. `secret`: shared HMAC secret of all peers.
    """

    instance_id: int
    capacity_pages: int
    host: str = "127.0.0.1"
    port: int = 0
    writeback_peers: tuple[Peer, ...] = ()
    page_size: int | None = None
    secret: str | None = None
    timeout_s: float = 5.0
    writeback_concurrency: int = 16
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def writeback(self) -> bool:
        return bool(self.writeback_peers)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> BackendConfig:
        """Parse SGLang's extra-config dict; ValueError naming the key on anything wrong."""
        if not isinstance(extra, dict):
            raise ValueError(
                "the MemPool HiCache backend needs --hicache-storage-backend-extra-config "
                "with at least mempool_instance_id and mempool_capacity_pages"
            )
        known = {
            "mempool_instance_id",
            "mempool_capacity_pages",
            "mempool_host",
            "mempool_port",
            "mempool_writeback_peers",
            "mempool_page_size",
            "mempool_secret",
            "mempool_timeout_s",
            "mempool_writeback_concurrency",
        }
        unknown = sorted(k for k in extra if k.startswith(PREFIX) and k not in known)
        if unknown:
            raise ValueError(f"unknown MemPool backend keys {unknown}; known: {sorted(known)}")
        for key in ("mempool_instance_id", "mempool_capacity_pages"):
            if key not in extra:
                raise ValueError(f"missing required key {key!r} in the backend's extra config")
        instance_id = _int(extra, "mempool_instance_id")
        _check_id("mempool_instance_id", instance_id)
        capacity = _int(extra, "mempool_capacity_pages")
        if capacity <= 0:
            raise ValueError(f"mempool_capacity_pages must be positive, got {capacity}")
        port = _int(extra, "mempool_port", 0)
        if port:
            _check_port("mempool_port", port)
        host = extra.get("mempool_host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise ValueError(f"mempool_host must be a host name or address, got {host!r}")
        peers_raw = extra.get("mempool_writeback_peers", [])
        if isinstance(peers_raw, str):
            peers_raw = [p for p in peers_raw.split(",") if p.strip()]
        if not isinstance(peers_raw, list):
            raise ValueError(f"mempool_writeback_peers must be a list, got {peers_raw!r}")
        peers = tuple(Peer.parse(p.strip() if isinstance(p, str) else p) for p in peers_raw)
        if any(p.instance_id == instance_id for p in peers):
            raise ValueError(f"mempool_writeback_peers names this instance ({instance_id})")
        page_size = extra.get("mempool_page_size")
        if page_size is not None:
            page_size = _int(extra, "mempool_page_size")
            if page_size <= 0:
                raise ValueError(f"mempool_page_size must be positive, got {page_size}")
        secret = extra.get("mempool_secret")
        if secret is not None and not isinstance(secret, str):
            raise ValueError("mempool_secret must be a string")
        timeout = extra.get("mempool_timeout_s", 5.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"mempool_timeout_s must be a positive number, got {timeout!r}")
        concurrency = _int(extra, "mempool_writeback_concurrency", 16)
        if concurrency <= 0:
            raise ValueError(f"mempool_writeback_concurrency must be positive, got {concurrency}")
        return cls(
            instance_id,
            capacity,
            host,
            port,
            peers,
            page_size,
            secret,
            float(timeout),
            concurrency,
            {k: v for k, v in extra.items() if not k.startswith(PREFIX)},
        )


def _int(extra: dict[str, Any], key: str, default: int | None = None) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _check_id(key: str, value: int) -> None:
    if not 0 < value < 1 << 16:
        raise ValueError(f"{key} must be in 1..65535 (MemPool addresses hold 16 bits), got {value}")


def _check_port(key: str, value: int) -> None:
    if not 0 < value < 1 << 16:
        raise ValueError(f"{key} must be a TCP port in 1..65535, got {value}")

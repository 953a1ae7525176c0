"""The HiCache storage backend SGLang loads: `MemPoolStorage`.

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mempool",
        "module_path": "connector.sglang.backend", "class_name": "MemPoolStorage",
        "interface_v1": 1, "mempool_instance_id": 1, "mempool_capacity_pages": 65536, ...}'

SGLang's `StorageBackendFactory` imports the module and calls
`MemPoolStorage(storage_config, kwargs)`, then `register_mem_pool_host(host_pool)`; the pool
is built there, once the page size in bytes is known. With `interface_v1` SGLang uses the
zero-copy calls (`batch_get_v1`/`batch_set_v1`: host-pool indices, no intermediate page
tensors): bytes go straight between SGLang's host pool and MemPool's blocks, one copy each
way. Stored bytes are SGLang's flat data page (`get_data_page(i, flat=True)`), the same
bytes its file backend writes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from connector.sglang.config import BackendConfig
from connector.sglang.runtime import PoolRuntime, WritebackStats
from connector.sglang.version import check_version

log = logging.getLogger(__name__)


class MemPoolStorage(HiCacheStorage):
    """SGLang L3 pages in MemPool; a decode server also pushes them to its prefill peers."""

    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None
    ) -> None:
        self.sglang_version = check_version()
        self.config = BackendConfig.from_extra(storage_config.extra_config)
        self.storage_config = storage_config
        # Each TP/PP rank holds its own shard of every page: its own pool and instance id.
        self.rank = storage_config.tp_rank + storage_config.tp_size * storage_config.pp_rank
        self.runtime: PoolRuntime | None = None
        self.mem_pool_host: Any = None

    # ----------------------------------------------------------------- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool is known: check its page size and start the pool."""
        if self.runtime is not None:
            raise RuntimeError("register_mem_pool_host called twice on the MemPool backend")
        page_size = int(mem_pool_host.page_size)
        want = self.config.page_size
        if want is not None and want != page_size:
            raise ValueError(
                f"page size mismatch: the MemPool backend was configured for "
                f"mempool_page_size={want} tokens, but this server's host pool has pages of "
                f"{page_size} tokens (--page-size); prefill and decode must use the same"
            )
        page = mem_pool_host.get_dummy_flat_data_page()
        page_bytes = page.numel() * page.element_size()
        super().register_mem_pool_host(mem_pool_host)
        self.runtime = PoolRuntime(self.config, page_bytes, self.rank)
        log.info(
            "MemPool HiCache backend: instance %d, %d pages of %d bytes, listening on %s, "
            "writeback to %s",
            self.runtime.instance_id,
            self.config.capacity_pages,
            page_bytes,
            self.runtime.stats()["listen"],
            [f"{p.instance_id}@{p.host}:{p.port}" for p in self.runtime.peers] or "nobody",
        )

    def _rt(self) -> PoolRuntime:
        if self.runtime is None:
            raise RuntimeError(
                "the MemPool backend has no pool yet: SGLang calls register_mem_pool_host "
                "right after creating it"
            )
        return self.runtime

    # ----------------------------------------------------------------- zero-copy (v1)

    def _page_views(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[torch.Tensor]:
        """Each key's page in SGLang's host pool, as a strided view (no copy)."""
        host = self.mem_pool_host
        page = int(host.page_size)
        if host_indices.numel() != len(keys) * page:
            raise ValueError(
                f"{len(keys)} keys need {len(keys) * page} host indices (pages of {page} "
                f"tokens), got {host_indices.numel()}"
            )
        views = [host.get_data_page(int(i), flat=False) for i in host_indices[::page].tolist()]
        want = self._rt().page_bytes
        for start, view in zip(host_indices[::page].tolist(), views, strict=True):
            if view.numel() * view.element_size() != want:
                raise ValueError(
                    f"host index {start} does not start a whole page of the host pool "
                    f"({view.numel() * view.element_size()} of {want} bytes there)"
                )
        return views

    def _block(self, addr: int, like: torch.Tensor) -> torch.Tensor:
        """A MemPool block as a tensor shaped like one page of the host pool (no copy)."""
        return torch.frombuffer(self._rt().view(addr), dtype=like.dtype).view(like.shape)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        views = self._page_views(keys, host_indices)
        with self._rt().pinned(keys) as found:
            for view, hit in zip(views, found, strict=True):
                if hit is not None:
                    view.copy_(self._block(hit.addrs[0], view))
        return [hit is not None for hit in found]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        views = self._page_views(keys, host_indices)
        with self._rt().filling(keys) as addrs:
            for view, addr in zip(views, addrs, strict=True):
                if addr is not None:
                    self._block(addr, view).copy_(view)
        return [True] * len(keys)

    # ----------------------------------------------------------------- tensors (legacy)

    def _bytes_of(self, addr: int, numel_bytes: int) -> torch.Tensor:
        rt = self._rt()
        if numel_bytes != rt.page_bytes:
            raise ValueError(
                f"page size mismatch: a page here is {rt.page_bytes} bytes, got a tensor of "
                f"{numel_bytes} bytes"
            )
        return torch.frombuffer(rt.view(addr), dtype=torch.uint8)

    @staticmethod
    def _raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.uint8)

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Copy each cached page into its target tensor (SGLang passes flat dummy pages)."""
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one target tensor per key")
        out: list[torch.Tensor | None] = []
        with self._rt().pinned(keys) as found:
            for target, hit in zip(target_locations, found, strict=True):
                if hit is None:
                    out.append(None)
                    continue
                nbytes = target.numel() * target.element_size()
                src = self._bytes_of(hit.addrs[0], nbytes)
                if target.is_contiguous():
                    target.view(-1).view(torch.uint8).copy_(src)
                else:
                    target.copy_(src.view(target.dtype).view(target.shape))
                out.append(target)
        return out

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one value tensor per key")
        with self._rt().filling(keys) as addrs:
            for value, addr in zip(values, addrs, strict=True):
                if addr is not None:
                    raw = self._raw(value)
                    self._bytes_of(addr, raw.numel()).copy_(raw)
        return True

    # ----------------------------------------------------------------- lookups

    def exists(self, key: str) -> bool:
        return self._rt().exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        return self._rt().exists(keys)

    # ----------------------------------------------------------------- the rest

    def clear(self) -> None:
        self._rt().clear()

    def get_stats(self) -> None:
        """SGLang's StorageMetrics are per-call bandwidths we do not collect; see `stats`."""
        return None

    def stats(self) -> dict[str, Any]:
        """The pool's use and the writeback totals (pages sent, skipped, failures)."""
        return {"sglang": self.sglang_version, **self._rt().stats()}

    def drain(self, timeout: float | None = None) -> WritebackStats:
        """Wait for the writebacks started so far (tests, benchmarks, shutdown)."""
        return self._rt().drain(timeout)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

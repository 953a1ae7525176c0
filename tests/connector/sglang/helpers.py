"""Shared pieces of the SGLang backend tests: configs, backends built SGLang's way, keys."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from connector.sglang.backend import MemPoolStorage
from connector.sglang.cpu_paths import HostPool, storage_config

PAGE = 4  # SGLang tokens per page in these tests
GEOMETRY: dict[str, Any] = {
    "layer_num": 3,
    "head_num": 2,
    "head_dim": 8,
}  # 768 bytes a page in fp16 (K and V)


def extra(**overrides: Any) -> dict[str, Any]:
    """The extra-config JSON a user passes, as a dict."""
    cfg: dict[str, Any] = {
        "backend_name": "mempool",
        "module_path": "connector.sglang.backend",
        "class_name": "MemPoolStorage",
        "interface_v1": 1,
        "mempool_instance_id": 1,
        "mempool_capacity_pages": 64,
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


def host_pool(
    size: int = 128, layout: str = "layer_first", seed: int | None = None, page: int = PAGE
) -> HostPool:
    pool = HostPool(size, page, layout=layout, **GEOMETRY)
    if seed is not None:
        pool.fill(seed)
    return pool


def create(extra_config: dict[str, Any], host: HostPool | None = None) -> MemPoolStorage:
    """What HiCacheController.attach_storage_backend does: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config), host)
    assert isinstance(backend, MemPoolStorage)
    backend.register_mem_pool_host(host if host is not None else host_pool())
    return backend


def keys_of(tokens: list[int], page: int = PAGE) -> list[str]:
    """SGLang's page keys for a token sequence (its native SHA-256 chain)."""
    out = get_hash_str(tokens[: len(tokens) // page * page], None, page_size=page)
    assert isinstance(out, list)
    return out


def page_digest(host: HostPool, start: int) -> str:
    """SHA-256 of one page's flat bytes in a host pool (what storage holds)."""
    data = host.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def indices(pages: int, first_page: int = 0, page: int = PAGE) -> torch.Tensor:
    return torch.arange(first_page * page, (first_page + pages) * page, dtype=torch.int64)

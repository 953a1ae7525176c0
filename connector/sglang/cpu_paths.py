"""SGLang's own storage call paths and host-pool page code, run on a CPU (tests, benchmark).

`HiCacheController` (sglang/srt/managers/cache_controller.py) and `MHATokenToKVPoolHost`
(sglang/srt/mem_cache/pool_host/mha.py) cannot be imported here: their modules import the
whole engine, down to a CUDA build of torchvision whose operators do not load next to CPU
torch (PyPI has no CPU torchvision). So we take the methods that talk to a storage backend
and the page-layout methods verbatim from the installed wheel's source (parsed with `ast`,
compiled with the wheel's file name, so tracebacks point into SGLang) and run them on small
objects that hold what those methods read. Nothing in them is rewritten. What is left out is
the GPU side: device pools, CUDA streams and kernels, and the TP all-reduce of hit counts.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path
from queue import Queue
from typing import Any

import torch

CONTROLLER_METHODS = (
    "_storage_hit_query",
    "_page_transfer",
    "_page_transfer_kv_batch",
    "_page_get_zero_copy",
    "_page_set_zero_copy",
    "_generic_page_get",
    "_generic_page_set",
    "_page_backup",
)
CONTROLLER_CLASSES = ("PrefetchAck", "StorageOperation", "PrefetchOperation")
HOST_POOL_METHODS = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
# Imports those methods need; the engine-wide ones (dp_attention, memory_pool, ...) are not.
ALLOWED_IMPORTS = (
    "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.mem_cache.utils",
)


def sglang_file(relative: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed (bash scripts/install.sh installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _load(relative: str, classes: dict[str, tuple[str, ...] | None]) -> dict[str, Any]:
    """Compile the named classes of an SGLang module (only `methods` of each when given)
    with the module's stdlib, torch and allowed SGLang imports; return its namespace."""
    path = sglang_file(relative)
    tree = ast.parse(path.read_text(), filename=str(path))
    body: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            src = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if src and (src.split(".")[0] != "sglang" or src in ALLOWED_IMPORTS):
                body.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in classes:
            methods = classes[node.name]
            if methods is not None:
                kept = [
                    n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods
                ]
                missing = set(methods) - {n.name for n in kept}
                if missing:
                    raise RuntimeError(f"{path}: {node.name} has no {sorted(missing)}")
                node.body = list(kept)
                node.bases = []
                node.decorator_list = []
            found.add(node.name)
            body.append(node)
    if found != set(classes):
        raise RuntimeError(f"{path}: classes {sorted(set(classes) - found)} not found")
    module = ast.Module(body=body, type_ignores=[])
    name = f"sglang_extract.{path.stem}"
    mod = types.ModuleType(name)
    mod.__dict__["logger"] = logging.getLogger(name)
    sys.modules[name] = mod  # dataclasses look their module up
    exec(compile(module, str(path), "exec"), mod.__dict__)
    return mod.__dict__


_CONTROLLER: dict[str, Any] = _load(
    "srt/managers/cache_controller.py",
    {"HiCacheController": CONTROLLER_METHODS, **dict.fromkeys(CONTROLLER_CLASSES)},
)
_HOST: dict[str, Any] = _load(
    "srt/mem_cache/pool_host/mha.py", {"MHATokenToKVPoolHost": HOST_POOL_METHODS}
)
_HostBase: Any = _HOST["MHATokenToKVPoolHost"]
_ControllerBase: Any = _CONTROLLER["HiCacheController"]
PrefetchOperation = _CONTROLLER["PrefetchOperation"]
StorageOperation = _CONTROLLER["StorageOperation"]


class HostPool(_HostBase):
    """SGLang's MHA host pool page methods over a CPU buffer laid out as its init_kv_buffer
    lays it out (layer_first or page_first)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        layout: str = "layer_first",
    ) -> None:
        self.size, self.page_size, self.layout = size, page_size, layout
        self.layer_num, self.head_num, self.head_dim = layer_num, head_num, head_dim
        self.dtype, self.device, self.pin_memory = dtype, "cpu", False
        if layout == "layer_first":
            dims = (2, layer_num, size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, size, layer_num, head_num, head_dim)
        else:
            raise ValueError(f"layout {layout!r} not modelled here")
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def fill(self, seed: int) -> None:
        """Deterministic, distinct bytes in every slot."""
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.dtype))


class Controller(_ControllerBase):
    """HiCacheController's storage methods with the state they read (one rank, no GPU)."""

    def __init__(self, backend: Any, host_pool: HostPool, zero_copy: bool = True) -> None:
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = host_pool
        self.page_size = host_pool.page_size
        # attach_storage_backend's choice for `dynamic` with interface_v1
        if zero_copy:
            self.page_get_func, self.page_set_func = (
                self._page_get_zero_copy,
                self._page_set_zero_copy,
            )
        else:
            self.page_get_func, self.page_set_func = self._generic_page_get, self._generic_page_set
        self.prefetch_sync_queue: Queue[Any] = Queue()
        self.lock = threading.Lock()

    def backup(self, host_indices: torch.Tensor, hashes: list[str]) -> int:
        """write_storage + the backup thread's step: returns tokens written."""
        op = StorageOperation(host_indices, [], hash_value=hashes)
        self._page_backup(op)
        return int(op.completed_tokens)

    def prefetch(
        self, tokens: list[int], host_indices: torch.Tensor, last_hash: str | None = None
    ) -> tuple[int, int]:
        """The prefetch thread's hit query, then the I/O thread's transfer into `host_indices`:
        (tokens found by batch_exists, pages read by batch_get)."""
        op = PrefetchOperation("req", tokens, last_hash)
        hashes, hit_tokens = self._storage_hit_query(op)
        op.hash_value = hashes
        op.host_indices = host_indices[:hit_tokens]
        pages = self._page_transfer(op) if hashes else 0
        return hit_tokens, pages


def storage_config(extra_config: dict[str, Any], model_name: str = "cpu") -> Any:
    """SGLang's HiCacheStorageConfig as one tensor-parallel rank of an MHA model builds it,
    with `extra_config` (what --hicache-storage-backend-extra-config gives a backend)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model_name,
        extra_config=extra_config,
    )

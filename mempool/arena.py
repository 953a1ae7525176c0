"""Arenas: one region per memory tier, allocated once at start and cut into fixed-size blocks.

One region per tier (KVDirect and the multi-vendor PD paper register one pinned buffer once)
lets a transport register memory a single time and name any block by offset.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass, field
from typing import Literal

from mempool.address import MemType
from mempool.errors import MemPoolError

HUGE_PAGE_BYTES = 2 * 1024 * 1024
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
HugePages = Literal["auto", "off", "require"]


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass
class HostArena:
    """Host DRAM: an anonymous mmap, on MAP_HUGETLB huge pages when the OS grants them.

    `backing` says what was obtained: "hugetlb" (explicit huge pages), "thp" (normal pages
    advised for transparent huge pages) or "pages". `huge_pages="require"` raises instead of
    falling back. `emulated_device=True` labels the arena as the stand-in for device memory on
    machines without a GPU (same interface, host bytes underneath).
    """

    num_blocks: int
    block_size: int
    huge_pages: HugePages = "auto"
    emulated_device: bool = False
    reserve: bool = True
    backing: str = field(init=False, default="pages")
    mem_type: MemType = field(init=False, default=MemType.HOST)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise MemPoolError(
                f"arena needs positive num_blocks and block_size, got "
                f"{self.num_blocks} x {self.block_size}"
            )
        self.nbytes = self.num_blocks * self.block_size
        self._map = self._map_region()
        self._view = memoryview(self._map)
        if self.emulated_device:
            self.mem_type = MemType.DEVICE
            self.backing = f"emulated-device({self.backing})"

    def _map_region(self) -> mmap.mmap:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if not self.reserve:
            flags |= _MAP_NORESERVE
        if self.huge_pages != "off":
            try:
                region = mmap.mmap(
                    -1, _round_up(self.nbytes, HUGE_PAGE_BYTES), flags=flags | _MAP_HUGETLB
                )
                self.backing = "hugetlb"
                return region
            except OSError as exc:
                if self.huge_pages == "require":
                    raise MemPoolError(
                        f"huge pages required but the OS refused {self.nbytes} bytes "
                        f"({exc}); reserve some in /proc/sys/vm/nr_hugepages"
                    ) from exc
        region = mmap.mmap(-1, self.nbytes, flags=flags)
        if self.huge_pages != "off" and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
                self.backing = "thp"
            except OSError:
                self.backing = "pages"
        return region

    @property
    def base_address(self) -> int:
        """Virtual address of the region, for a transport's one-time memory registration."""
        return ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def region(self) -> memoryview:
        """Zero-copy view of the whole arena (what a transport registers and copies into)."""
        return self._view

    def view(self, block: int) -> memoryview:
        """Zero-copy view of one block."""
        start = block * self.block_size
        return self._view[start : start + self.block_size]

    def read(self, block: int) -> bytes:
        return bytes(self.view(block))

    def write(self, block: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != self.block_size:
            raise MemPoolError(f"block write of {len(data)} bytes, block size is {self.block_size}")
        self.view(block)[:] = data

    def close(self) -> None:
        """Unmap; MemPoolError, arena still usable, while views of its blocks are alive."""
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            self._view = memoryview(self._map)
            raise MemPoolError(
                "cannot close the arena while views of its blocks are alive; drop them first"
            ) from None


class CudaArena:
    """Device memory: one torch CUDA uint8 tensor. Used only where torch sees a GPU.

    Not exercised on our CPU-only machines; MemPool falls back to an emulated device arena
    there and says so in its stats.
    """

    def __init__(self, num_blocks: int, block_size: int, device: str = "cuda") -> None:
        import torch  # imported lazily: torch is optional for MemPool

        if not torch.cuda.is_available():
            raise MemPoolError("a CUDA device arena was requested but torch sees no GPU")
        self._torch = torch
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.nbytes = num_blocks * block_size
        self.mem_type = MemType.DEVICE
        self.backing = "cuda"
        self._tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    @property
    def base_address(self) -> int:
        return int(self._tensor.data_ptr())

    def read(self, block: int) -> bytes:
        start = block * self.block_size
        return self._tensor[start : start + self.block_size].cpu().numpy().tobytes()

    def write(self, block: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != self.block_size:
            raise MemPoolError(f"block write of {len(data)} bytes, block size is {self.block_size}")
        start = block * self.block_size
        src = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
        self._tensor[start : start + self.block_size].copy_(src)

    def close(self) -> None:
        del self._tensor


def cuda_available() -> bool:
    """True when torch is importable and sees a GPU; never imports torch needlessly twice."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


Arena = HostArena | CudaArena


def make_arena(
    mem_type: MemType,
    num_blocks: int,
    block_size: int,
    huge_pages: HugePages = "auto",
    reserve: bool = True,
) -> Arena:
    """Host tier: mmap. Device tier: CUDA when present, else the emulated host stand-in."""
    if mem_type is MemType.HOST:
        return HostArena(num_blocks, block_size, huge_pages, reserve=reserve)
    if cuda_available():
        return CudaArena(num_blocks, block_size)
    return HostArena(num_blocks, block_size, huge_pages="off", emulated_device=True)

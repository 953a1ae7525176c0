"""Arenas: one region per tier, huge pages when granted, a clean fallback when not."""

from pathlib import Path

import pytest

from mempool.address import MemType
from mempool.arena import HostArena, make_arena
from mempool.errors import MemPoolError


def huge_pages_free() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


def test_host_arena_blocks_are_independent_and_addressable() -> None:
    arena = HostArena(8, 4096)
    arena.write(3, b"\x07" * 4096)
    assert arena.read(3) == b"\x07" * 4096
    assert arena.read(2) == bytes(4096) and arena.read(4) == bytes(4096)
    assert arena.base_address > 0
    assert arena.backing in {"hugetlb", "thp", "pages"}
    arena.close()


def test_huge_pages_fall_back_cleanly_or_are_used() -> None:
    arena = HostArena(4, 1024, huge_pages="auto")
    if huge_pages_free():
        assert arena.backing == "hugetlb"
    else:
        assert arena.backing in {"thp", "pages"}
    arena.view(0)[:4] = b"abcd"
    assert arena.read(0)[:4] == b"abcd"
    arena.close()


@pytest.mark.skipif(huge_pages_free() > 0, reason="this machine grants huge pages")
def test_required_huge_pages_refused_with_clear_error() -> None:
    with pytest.raises(MemPoolError, match="huge pages required"):
        HostArena(4, 1024, huge_pages="require")


def test_off_means_plain_pages() -> None:
    assert HostArena(2, 64, huge_pages="off").backing == "pages"


def test_device_tier_without_gpu_is_labelled_emulated() -> None:
    arena = make_arena(MemType.DEVICE, 4, 256)
    assert arena.mem_type is MemType.DEVICE
    assert arena.backing == "cuda" or arena.backing.startswith("emulated-device")


@pytest.mark.parametrize(("blocks", "size"), [(0, 64), (4, 0), (-1, 64)])
def test_bad_arena_sizes(blocks: int, size: int) -> None:
    with pytest.raises(MemPoolError, match="positive"):
        HostArena(blocks, size)


def test_write_of_wrong_length_refused() -> None:
    arena = HostArena(2, 64)
    with pytest.raises(MemPoolError, match="block size is 64"):
        arena.write(0, b"short")
    assert arena.read(0) == bytes(64)

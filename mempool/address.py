"""Block addresses: one 64-bit int naming the owning instance, the memory tier and the block.

Any address names its owner, so a block seen anywhere in the cluster (an index entry, a
transfer request, a router hint) says where its bytes live without a lookup.
Layout, high to low bits: instance id (16) | memory type (8) | block index (40).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

INSTANCE_BITS = 16
TYPE_BITS = 8
BLOCK_BITS = 40
MAX_INSTANCE_ID = (1 << INSTANCE_BITS) - 1
MAX_BLOCKS = 1 << BLOCK_BITS
_TYPE_SHIFT = BLOCK_BITS
_INSTANCE_SHIFT = BLOCK_BITS + TYPE_BITS
_BLOCK_MASK = MAX_BLOCKS - 1
_TYPE_MASK = (1 << TYPE_BITS) - 1


class MemType(IntEnum):
    """Memory tiers. DEVICE is accelerator memory (HBM); HOST is DRAM."""

    DEVICE = 1
    HOST = 2

    @classmethod
    def parse(cls, value: object) -> MemType:
        """Accept a MemType, its int value or its name ('host', 'device'); else ValueError."""
        if isinstance(value, MemType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            try:
                return cls(value)
            except ValueError:
                pass
        names = ", ".join(m.name.lower() for m in cls)
        raise ValueError(f"unknown memory type {value!r}; expected one of: {names}")


class Address(NamedTuple):
    """The decoded form of a block address."""

    instance: int
    mem_type: MemType
    block: int


def encode(instance: int, mem_type: MemType, block: int) -> int:
    """Pack an address; raises ValueError when a field does not fit."""
    if not 0 <= instance <= MAX_INSTANCE_ID:
        raise ValueError(f"instance id {instance} outside 0..{MAX_INSTANCE_ID}")
    if not 0 <= block < MAX_BLOCKS:
        raise ValueError(f"block index {block} outside 0..{MAX_BLOCKS - 1}")
    return (instance << _INSTANCE_SHIFT) | (int(mem_type) << _TYPE_SHIFT) | block


def decode(addr: int) -> Address:
    """Unpack an address; raises ValueError for a negative, oversized or untyped value."""
    if isinstance(addr, bool) or not isinstance(addr, int):
        raise ValueError(f"address must be an int, got {type(addr).__name__}")
    if addr < 0 or addr >> (_INSTANCE_SHIFT + INSTANCE_BITS):
        raise ValueError(f"address {addr:#x} is not a 64-bit block address")
    type_value = (addr >> _TYPE_SHIFT) & _TYPE_MASK
    try:
        mem_type = MemType(type_value)
    except ValueError:
        raise ValueError(f"address {addr:#x} names unknown memory type {type_value}") from None
    return Address(addr >> _INSTANCE_SHIFT, mem_type, addr & _BLOCK_MASK)


def instance_of(addr: int) -> int:
    """The instance id an address belongs to (no validation: for hot paths)."""
    return addr >> _INSTANCE_SHIFT


def mem_type_of(addr: int) -> int:
    """The memory type value of an address (no validation: for hot paths)."""
    return (addr >> _TYPE_SHIFT) & _TYPE_MASK


def block_of(addr: int) -> int:
    """The block index of an address (no validation: for hot paths)."""
    return addr & _BLOCK_MASK

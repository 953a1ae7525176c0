"""Exceptions MemPool raises; every one says what was wrong and leaves the pool unchanged."""


class MemPoolError(Exception):
    """Base class: any MemPool call that refuses its input raises a subclass of this."""


class OutOfBlocks(MemPoolError):
    """Not enough free blocks of the requested memory type; nothing was allocated."""


class InvalidAddress(MemPoolError):
    """An address that this pool does not own, or that is not in the state the call needs."""


class BlockInUse(MemPoolError):
    """The blocks are referenced by the index or locked by a running request."""


class InvalidRequest(MemPoolError, ValueError):
    """A call's arguments are malformed (wrong size, length, value or instance)."""


class InvalidTokens(InvalidRequest, TypeError):
    """Tokens that are not a sequence of int token ids."""

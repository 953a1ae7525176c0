"""The likely ids of a new text's beginning, from the encode of an earlier text that shared it.

A router decides before it has encoded a prompt's new text (encoding 15K tokens takes tens
of milliseconds; `CachedEncoder` does it after the send). Cached pieces give exact ids, but a
text that changes only after a long shared start (a document with a new question, an agent's
tool list with a new call) is a new piece, and a piece can only be cut into cached chunks
where the tokenizer is known to split: before a space between two letters, which Chinese,
Japanese, digits, code and random text often lack. So without this the router saw nothing of
such a prompt and routed it blind.

Tokenizers are local: a token depends on the characters around it, not on text far after it.
An earlier text's encode, cut a little before the point where the new text departs from it,
is then the new text's encode up to there. `PrefixIndex` keeps recent long pieces with each
token's end offset, finds the earlier piece sharing the longest start with a new one (chained
hashes of fixed blocks of characters, then the exact point within a block), and returns that
piece's ids that end `MARGIN_CHARS` before the parting point, less `MARGIN_TOKENS` more.

It is a guess: the decision uses it, nothing is recorded from it. The prompt's exact ids are
encoded after the send as before, and compared with the guess (`CachedEncoder.stats`:
`guess_mismatches`). Measured on 1,500 random parting points per tokenizer over Chinese,
Japanese, digits, code, no-space, whitespace-run, emoji and random-unicode texts, with a
byte-level BPE (SmolLM2), DeepSeek-V4's and a SentencePiece BPE (Mistral 7B v0.1): a margin of
4 characters and 1 token guessed wrong once in 4,500 (a token near the end: the prediction
then runs a few tokens long) and left out 5-7 tokens of the shared start on average, 16-17
at the 99th percentile; 16 characters and 2 tokens never guessed wrong but left out 20-25
(59-66). A page is 16 tokens or more, so the smaller margin.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

# The granularity of the shared-start search (refined to the character): blocks of 8, 8
# and 16 characters, then of BLOCK_CHARS (a lookup hashes a block of the new piece per
# 0.3 us). A shared start shorter than FIRST_CHARS is not guessed.
BLOCK_CHARS = 32
FIRST_CHARS = 8
MIN_CHARS = 2 * FIRST_CHARS  # shorter pieces are not indexed
MARGIN_CHARS = 4  # tokens ending this close to the parting point may change
MARGIN_TOKENS = 1  # and this many more before them

_EMPTY = array("I")


class Encoded(Protocol):
    """An encode of a piece that can say where its tokens are (HF tokenizers' Encoding)."""

    @property
    def offsets(self) -> list[tuple[int, int]]: ...


@dataclass(slots=True)
class _Piece:
    text: str
    ids: array  # uint32 ids of `text`
    # uint32: ends[i] = the character offset where token i ends (non-decreasing); None until
    # read from `encoded` (reading an encode's offsets costs 0.1 ms a thousand tokens: done
    # when a guess needs them, or by `settle`, off a request's path)
    ends: array | None
    encoded: Encoded | None = None

    def token_ends(self) -> array:
        if self.ends is None:
            assert self.encoded is not None
            self.ends = token_ends(self.encoded.offsets)
            self.encoded = None
        return self.ends


class PrefixIndex:
    """Recent long pieces by their leading blocks; bounded by the total of their tokens."""

    def __init__(self, max_tokens: int = 1_000_000) -> None:
        self.max_tokens = max_tokens
        self._pieces: OrderedDict[str, _Piece] = OrderedDict()  # LRU, the oldest first
        self._blocks: dict[int, _Piece] = {}  # chained hash of text[: k * BLOCK_CHARS]
        self._tokens = 0
        self._unsettled: list[_Piece] = []  # pieces whose ends are still to read

    @property
    def unsettled(self) -> int:
        """Pieces added with an encode whose token ends are not read yet (`settle`)."""
        return len(self._unsettled)

    def __len__(self) -> int:
        return len(self._pieces)

    def add(self, text: str, ids: array, ends: array | Encoded) -> None:
        """Index `text`, encoded as `ids`, token i ending at character `ends[i]`
        (`token_ends`), or the encode to read those ends from when needed."""
        if len(text) < MIN_CHARS or text in self._pieces or len(ids) > self.max_tokens:
            return
        if isinstance(ends, array):
            if len(ids) != len(ends):
                return
            piece = _Piece(text, ids, ends)
        else:
            piece = _Piece(text, ids, None, ends)
            self._unsettled.append(piece)
        self._pieces[text] = piece
        self._tokens += len(ids)
        for _, key in _chain(text):
            self._blocks[key] = piece  # the newest holder of a start wins
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._pieces.values())))

    def guess(self, text: str) -> array:
        """The likely first ids of `text` (empty when no indexed piece shares a block)."""
        if len(text) < FIRST_CHARS or not self._blocks:
            return _EMPTY
        found: _Piece | None = None
        start = 0
        get = self._blocks.get
        for end, key in _chain(text):
            piece = get(key)
            if piece is None:
                break
            found, start = piece, end
        if found is None:
            return _EMPTY
        if found.text[:start] != text[:start]:  # a hash collision: guess nothing
            return _EMPTY
        self._pieces.move_to_end(found.text)
        shared = start + _common_start(found.text, text, start, _next_end(start))
        ends = found.token_ends()
        if len(ends) != len(found.ids):  # an encode whose offsets do not match its ids
            self._drop(found)
            return _EMPTY
        n = bisect_right(ends, shared - MARGIN_CHARS) - MARGIN_TOKENS
        return found.ids[:n] if n > 0 else _EMPTY

    def settle(self) -> None:
        """Read the token ends of every piece added with an encode (and free the encodes)."""
        unsettled, self._unsettled = self._unsettled, []
        for piece in unsettled:
            # (a dropped piece's encode is None: _drop)
            if piece.encoded is not None and len(piece.token_ends()) != len(piece.ids):
                self._drop(piece)

    def ends(self, text: str) -> array | None:
        """The token ends `text` was indexed with, None when it is not indexed."""
        piece = self._pieces.get(text)
        return None if piece is None else piece.token_ends()

    def discard(self, text: str) -> None:
        """Forget `text` (its piece left the cache it was encoded for)."""
        piece = self._pieces.get(text)
        if piece is not None:
            self._drop(piece)

    def clear(self) -> None:
        self._pieces.clear()
        self._blocks.clear()
        self._unsettled.clear()
        self._tokens = 0

    def _drop(self, piece: _Piece) -> None:
        piece.encoded = None
        del self._pieces[piece.text]
        self._tokens -= len(piece.ids)
        for _, key in _chain(piece.text):
            if self._blocks.get(key) is piece:
                del self._blocks[key]


def _next_end(end: int) -> int:
    """The end of the block after the one ending at `end` (0: the first block's)."""
    if end < 2 * FIRST_CHARS:
        return end + FIRST_CHARS
    if end < BLOCK_CHARS:
        return BLOCK_CHARS
    return end + BLOCK_CHARS


def _chain(text: str) -> Iterator[tuple[int, int]]:
    """(end, hash of text[:end]) for each whole block of `text`: each block hashed once."""
    h, start, n = 0, 0, len(text)
    end = _next_end(0)
    while end <= n:
        h = hash((h, text[start:end]))
        yield end, h
        start, end = end, _next_end(end)


def _common_start(a: str, b: str, lo: int, hi: int) -> int:
    """How many characters a[lo:] and b[lo:] share, at most hi - lo (binary search over
    slice comparisons, which run in C)."""
    hi = min(hi, len(a), len(b))
    if a[lo:hi] == b[lo:hi]:
        return hi - lo
    low, high = lo, hi  # a[lo:low] == b[lo:low]; a[lo:high] != b[lo:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid
    return low - lo


def token_ends(offsets: Sequence[tuple[int, int]]) -> array:
    """Each token's end from an encode's (start, end) character offsets, never before an
    earlier token's (the tokens of one character's bytes share its offsets)."""
    out = array("I")
    high = 0
    for _, end in offsets:
        if end > high:
            high = end
        out.append(high)
    return out

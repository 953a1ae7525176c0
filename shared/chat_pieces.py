"""A chat's pieces without scanning its whole text for added tokens.

`CachedEncoder` splits a rendered chat at its added tokens with one regex over the text:
about half a nanosecond a character, 18 µs for an 8K-token chat, on every turn. A chat
rendered by substitution (shared.chat_skeleton) is `fixed[0] + content[0] + fixed[1] + ...`,
and the added tokens are nearly always in the fixed parts. Those are split once per chat
shape; a turn then only checks that no content holds a character an added token starts
with (a `str.__contains__` a content) and joins the pieces around the contents.

Equal to the regex split of the whole text when both hold:
- no content holds the first character of an added token: no match starts in a content;
- no fixed part but the last ends with a proper prefix of an added token: no match that
  starts in a fixed part runs on into what follows it (its content, or the next fixed part
  when the content is empty).
Then every match lies inside one fixed part, and is found there as in the whole text (the
alternation tries the longest token first at each position, in both). Otherwise `parts`
returns None and the caller splits the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_STARTS = 4  # distinct first characters of added tokens checked in every content
MAX_TOKENS = 4096  # added tokens whose proper prefixes are kept (a set of every prefix)
MAX_SHAPES = 1024  # fixed-part lists whose split is kept


class PieceSplitter:
    """The pieces of `fixed[0] + contents[0] + ... + fixed[n]` as `pattern.split` gives them."""

    def __init__(self, pattern: re.Pattern[str], tokens: Sequence[str]) -> None:
        self.pattern = pattern
        self.starts = "".join(sorted({t[0] for t in tokens if t}))
        self.usable = 0 < len(self.starts) <= MAX_STARTS and len(tokens) <= MAX_TOKENS
        self._prefixes = {t[:k] for t in tokens for k in range(1, len(t))} if self.usable else set()
        self._longest = max((len(t) for t in tokens), default=0)
        # id(fixed) -> (fixed, its parts split, or None where a part may run on)
        self._splits: dict[int, tuple[list[str], list[list[str]] | None]] = {}

    def parts(self, fixed: list[str], contents: Sequence[str]) -> list[str] | None:
        """Alternating [piece, added token, ..., piece] of the joined text; None where it
        must be split as text (a content holds an added token's first character, or a
        fixed part may begin one that runs on)."""
        if not self.usable:
            return None
        split = self._split(fixed)
        if split is None:
            return None
        for start in self.starts:
            for content in contents:
                if start in content:
                    return None
        if len(split) != len(contents) + 1:
            return None
        out: list[str] = []
        piece: list[str] = []  # the piece being joined: it ends at the next added token
        for i, parts in enumerate(split):  # parts: [text, token, text, ..., text]
            if i:
                piece.append(contents[i - 1])
            piece.append(parts[0])
            if len(parts) > 1:
                out.append("".join(piece))
                out.extend(parts[1:-1])
                piece = [parts[-1]]
        out.append("".join(piece))
        return out

    def _split(self, fixed: list[str]) -> list[list[str]] | None:
        known = self._splits.get(id(fixed))
        if known is not None and known[0] is fixed:
            return known[1]
        split: list[list[str]] | None = [self.pattern.split(f) for f in fixed]
        if any(self._runs_on(f) for f in fixed[:-1]):
            split = None
        if len(self._splits) >= MAX_SHAPES:
            self._splits.clear()
        self._splits[id(fixed)] = (fixed, split)  # (kept: its id is not reused meanwhile)
        return split

    def _runs_on(self, text: str) -> bool:
        """Whether `text` ends with a proper prefix of an added token."""
        prefixes = self._prefixes
        return any(text[-k:] in prefixes for k in range(1, min(len(text), self._longest) + 1))

"""Deterministic text with exactly known token ids, so prompts, blocks and the oracle agree.

Every word is one token of the model's vocabulary with its leading space (`Ġword`), so a text
of n words is exactly n tokens, and the token ids of a prompt are known without asking the
tokenizer. Trace blocks end with a newline, which the tokenizer's pre-splitter keeps apart
from the next block's first word: the ids of a concatenation are the concatenation of the
ids, so block boundaries (and so prefix sharing) are stable.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

BLOCK_TOKENS = 512  # the Mooncake trace's block size


@dataclass
class Vocab:
    """Single-token words (ids and strings) and the newline token."""

    ids: list[int]
    words: list[str]
    newline_id: int
    _blocks: dict[tuple[int, int], tuple[str, list[int]]] = field(default_factory=dict, repr=False)
    _word_of: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._word_of = dict(zip(self.ids, self.words, strict=True))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, limit: int = 8000) -> Vocab:
        ids, words = [], []
        for token_id in range(tokenizer.vocab_size):
            piece = tokenizer.id_to_token(token_id) or ""
            word = piece[1:]
            plain = word.isascii() and word.isalpha() and word.islower()
            if piece.startswith("Ġ") and len(word) >= 3 and plain:
                ids.append(token_id)
                words.append(word)
                if len(ids) == limit:
                    break
        newline = tokenizer.encode("\n", add_special_tokens=False)
        if len(ids) < 100 or len(newline) != 1:
            raise RuntimeError("the tokenizer has too few single-token words for this benchmark")
        return cls(ids, words, newline[0])

    def words_text(self, rng: random.Random, n: int) -> tuple[str, list[int]]:
        """n seeded words: exactly n tokens (each word carries its leading space)."""
        picks = [rng.randrange(len(self.ids)) for _ in range(n)]
        return "".join(" " + self.words[i] for i in picks), [self.ids[i] for i in picks]

    def block(self, hash_id: int, seed: int = 0) -> tuple[str, list[int]]:
        """The trace block of `hash_id`: 511 words and a newline, 512 tokens."""
        got = self._blocks.get((seed, hash_id))  # seeds give other text
        if got is None:
            rng = random.Random(f"block:{seed}:{hash_id}")
            text, ids = self.words_text(rng, BLOCK_TOKENS - 1)
            got = (text + "\n", [*ids, self.newline_id])
            if len(self._blocks) < 200_000:
                self._blocks[(seed, hash_id)] = got
        return got

    def blocks_prompt(
        self, hash_ids: list[int], input_length: int, seed: int = 0
    ) -> tuple[str, list[int]]:
        """A prompt of `input_length` tokens from 512-token blocks (the last one cut)."""
        texts: list[str] = []
        ids: list[int] = []
        for k, hash_id in enumerate(hash_ids):
            text, block_ids = self.block(hash_id, seed)
            need = input_length - k * BLOCK_TOKENS
            if need <= 0:
                break
            if need < BLOCK_TOKENS:  # a cut block: its first `need` words
                block_ids = block_ids[:need]
                text = "".join(" " + self._word_of[i] for i in block_ids)
            texts.append(text)
            ids.extend(block_ids)
        if len(ids) < input_length:  # more tokens than blocks: pad with seeded words
            rng = random.Random(f"pad:{seed}:{hash_ids[-1] if hash_ids else 0}")
            text, pad = self.words_text(rng, input_length - len(ids))
            texts.append(text)
            ids.extend(pad)
        return "".join(texts), ids

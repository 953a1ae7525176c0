"""Router-side tokenization equal to the engine's, without re-tokenizing chat history.

The engine tokenizes a chat request as `ChatTokenizer.encode_chat(messages)`: render the chat
template, then encode the text with add_special_tokens=False. Multi-turn traffic resends the
whole history every turn, so the router would pay for an ~8K-token encode per request.

Why piece-wise encoding is exact: HF `tokenizers` first extracts every added token (special or
not) from the input (`AddedVocabulary::extract_and_normalize`: a leftmost-longest match of the
added tokens with normalized=False on the raw text, then of those with normalized=True on each
remaining piece after the normalizer ran). Each added token becomes its own id, and every
remaining piece is normalized, pre-tokenized and run through the model on its own: nothing
crosses a piece boundary. So encode(text) is the concatenation of encode(piece) over the pieces
between added tokens, and the added tokens' ids in between. Chat templates put special tokens
around every message, so a message's piece renders the same on every turn and its ids can be
cached: turn N renders the template (cheap), splits it with one precompiled regex (longest
alternative first, the same leftmost-longest match) and encodes only the pieces not cached.

What would break it, and makes `CachedEncoder` fall back to full encodes (correct, slower;
`stats()["mode"]` says why): added tokens with lstrip/rstrip (they swallow whitespace next to
them) or single_word, normalized added tokens under a normalizer, truncation or padding set on
the tokenizer, `encode_special_tokens`, BPE dropout, a tokenizer with no added tokens, and
anything that makes a piece depend on its position in the text (Metaspace
prepend_scheme="first"), which a self-test on probe texts catches at construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from shared.chat_pieces import PieceSplitter
from shared.chat_skeleton import SkeletonRenderer, join_fixed
from shared.text_prefix import MIN_CHARS, PrefixIndex
from shared.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

_PROBES = (
    "",
    " ",
    "Hello world",
    "  leading and trailing  ",
    "a\n\n b\t\tc \n",
    "caf\u00e9 \u4e2d\u6587 \U0001f642 \U0001f468\u200d\U0001f469\u200d\U0001f467",
)


# add_special_tokens=False: nothing goes around a text (never mutated)
_NO_SPECIAL = (array("I"), array("I"))
# New text longer than this (characters) is encoded on a thread, off the event loop
# (`complete_async`): about 1 ms of encoding; shorter text costs less than the thread hop.
OFF_LOOP_CHARS = 4096
BACKGROUND_NICE = 10  # that thread's CPU priority: below the loop's (and the workers')
# A piece (text between added tokens) longer than this many characters is cached in chunks
# cut about this often (`cut_text`): a long text prompt sharing a prefix with an
# earlier one (a tool prompt, a document) then encodes only the chunks after that prefix.
CUT_CHARS = 2048
CUT = ""  # in a split text, between two chunks of one piece: no token between them
# Pieces encoded inside an event loop have their tokens' ends read this long after (or
# when a guess needs them): that costs about 0.1 ms a thousand tokens, which a request's
# answer should not wait for (`PrefixIndex.settle`).
SETTLE_DELAY_S = 0.02
MAX_UNSETTLED = 256  # pieces waiting for it at most; then it is done at once


def _token_ids_array(ids: Sequence[int]) -> array:
    return array("I", ids)


class Known(NamedTuple):
    """A prompt as far as the router can tell before encoding its new text."""

    ids: array  # exact: the ids of its leading cached pieces
    rest: list[str]  # the rest to encode, alternating [piece, added token, ...]; [] if none
    guess: array  # the likely ids that follow `ids` (the start of rest[0]), not exact


class CachedEncoder:
    """`ChatTokenizer` encodes with a piece cache: the same ids, history encoded once.

    Pieces are the text between added tokens; the cache is LRU and bounded by the total
    number of cached token ids (stored as uint32, 4 bytes each). Not thread-safe (one
    asyncio loop). `verify_every=N` also runs a full encode on every Nth call and, on a
    mismatch, logs it, counts it and returns the full encode. `guesses`: keep long pieces in
    a prefix index, for the likely ids of new text that continues them (`Known.guess`; a
    router's, not an engine's).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        max_cached_tokens: int = 4_000_000,
        verify_every: int = 0,
        guesses: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.renderer = SkeletonRenderer(tokenizer)  # the template once per chat shape
        self._tok = tokenizer.hf_tokenizer  # the very Tokenizer the engine encodes with
        self.max_cached_tokens = max_cached_tokens
        self.verify_every = verify_every
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        self._calls = self._hits = self._misses = self._evictions = 0
        self._encoded_tokens = self._verified = self._mismatches = 0
        self._encoded_chars = 0  # of the pieces behind _encoded_tokens
        # Ids the post-processor puts around a text when add_special_tokens=True (prefix,
        # suffix); None when they are not fixed (text prompts then get full encodes).
        self._special: tuple[array, array] | None = None
        self._pool: ThreadPoolExecutor | None = None  # complete_async's thread, made on use
        self._encoding: dict[str, asyncio.Future[None]] = {}  # pieces on the thread now
        # long pieces encoded, by their start: a new piece's likely first ids (`Known.guess`)
        # (an engine encodes whole prompts and guesses nothing: guesses=False keeps none)
        self.prefixes = PrefixIndex(max_tokens=max(max_cached_tokens // 4, 1) if guesses else 0)
        self._guesses = self._guessed_tokens = self._guess_mismatches = 0
        self._settle_timer: asyncio.TimerHandle | None = None
        # told every piece this encoder encodes and caches (a router's sibling processes
        # cache them too: a piece one encoded is known to all)
        self.on_store: Callable[[list[tuple[str, array]]], None] | None = None
        self._pattern: re.Pattern[str] | None = None
        self._npattern: re.Pattern[str] | None = None
        self._splitter: PieceSplitter | None = None  # a chat's split by its parts
        self._added_arrays: dict[str, array] = {}
        self.mode = "piecewise"
        self.cuts = "off"  # whether long pieces are cached in chunks, or why not
        reason = self._setup()
        if reason is None:
            reason = self._self_test()
        if reason is not None:
            self.mode = f"full encode: {reason}"
            self._pattern = self._splitter = None
            log.warning(
                "CachedEncoder for %s falls back to full encodes: %s", tokenizer.path, reason
            )
        else:
            why = self._cut_test()
            self.cuts = f"off: {why}" if why else f"every {CUT_CHARS} characters"
            if why is None:
                self._added_arrays[CUT] = array("I")
        self._setup_special_tokens()

    # -- public API -----------------------------------------------------------------------

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Equal to `ChatTokenizer.encode_chat(messages, tools=..., add_generation_prompt=...)`."""
        return self.encode_chat_array(messages, tools, add_generation_prompt).tolist()

    def encode_chat_array(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> array:
        """`encode_chat` as an array('I') of uint32 ids (what radix keys are made of)."""
        text = self.renderer.render(messages, add_generation_prompt, tools)
        return self._encode(text, add_special_tokens=False)

    def encode_chat_known(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Known:
        """The chat's ids as far as its pieces are cached, the rest still to encode, and
        the likely ids of the rest's start.

        A router matches prompt trees with the known part and the guess: the new text (a
        turn's question, a new conversation's history) is encoded after the request has gone
        (`complete`), and where it only continues text encoded before (a document with a new
        question) the guess holds that text's ids. The rest is alternating [piece, added
        token, ...], [] when all is known.
        """
        self._calls += 1
        if self._pattern is None:
            text = self.renderer.render(messages, add_generation_prompt, tools)
            return Known(_token_ids_array(self._full(text, False)), [], _NO_SPECIAL[0])
        return self._known(self._chat_parts(messages, add_generation_prompt, tools), array("I"))

    def encode_text_known(self, text: str, add_special_tokens: bool = True) -> Known | None:
        """A text prompt's ids as far as its cached pieces (and chunks) go, the rest and the
        guess, as `encode_chat_known` splits a chat; `complete` gives the whole. None where
        text prompts get full encodes (no piece-wise encoding, or special ids after the
        text)."""
        special = self._special if add_special_tokens else _NO_SPECIAL
        if self._pattern is None or special is None or special[1]:
            return None
        self._calls += 1
        return self._known(self._split(text), array("I", special[0]))

    def _known(self, parts: list[str], out: array) -> Known:
        """`out` extended with the ids of the leading cached pieces of `parts`; the rest,
        and the guess of its first piece's ids."""
        added, extend = self._added_arrays, out.extend
        get, touch = self._cache.get, self._cache.move_to_end
        hits = 0
        for i in range(0, len(parts), 2):
            s = parts[i]
            if s:
                ids = get(s)
                if ids is None:
                    self._hits += hits
                    guess = self.prefixes.guess(s)
                    if guess:
                        self._guesses += 1
                        self._guessed_tokens += len(guess)
                    return Known(out, parts[i:], guess)
                touch(s)
                hits += 1
                extend(ids)
            if i + 1 < len(parts):
                extend(added[parts[i + 1]])
        self._hits += hits
        return Known(out, [], _NO_SPECIAL[0])

    def check_guess(self, guess: Sequence[int], exact: Sequence[int]) -> bool:
        """Whether a guess (`Known.guess`) was the start of the exact ids it stood for
        (`exact`: the ids that followed the known ones); a miss is counted and logged."""
        if exact[: len(guess)] == guess:
            return True
        self._guess_mismatches += 1
        if self._guess_mismatches & (self._guess_mismatches - 1):
            return False  # logged at the 1st, 2nd, 4th, 8th...: rare, but never a flood
        at = next(
            (i for i, (a, b) in enumerate(zip(guess, exact, strict=False)) if a != b), len(exact)
        )
        log.warning(
            "CachedEncoder: a guessed prefix of %d ids differed from the encode at id %d "
            "(%d such so far)",
            len(guess),
            at,
            self._guess_mismatches,
        )
        return False

    def complete(self, known: array, rest: list[str]) -> array:
        """`known` followed by the ids of `rest` (its new pieces encoded and cached)."""
        if not rest:
            return known
        return self._encode_parts(rest, array("I", known))

    def off_loop(self, rest: list[str]) -> bool:
        """Whether `complete_async` would encode `rest` on a thread (long new text)."""
        return self._pattern is not None and sum(map(len, self._missing(rest[0::2]))) >= (
            OFF_LOOP_CHARS
        )

    async def complete_async(self, known: array, rest: list[str]) -> array:
        """`complete`, with long new text (a cold prompt's history) encoded on a thread so
        the event loop keeps serving meanwhile: HF tokenizers release the GIL in batch
        encodes. Only the pieces the cache lacks go to the thread (no copy of the prompt);
        the cache itself is read and written on the loop only."""
        missing = self._missing(rest[0::2])
        if sum(map(len, missing)) < OFF_LOOP_CHARS:
            return self.complete(known, rest)
        if self._pool is None:
            self.start_thread()
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        for piece in missing:
            self._encoding.setdefault(piece, done)
        ends = _piece_ends(rest)
        try:
            encodings = await loop.run_in_executor(self._pool, self._encode_batch, missing, ends)
            encoded = self._ids_of(encodings)
            self._index(missing, encoded, encodings, ends)
            self._misses += len(missing)
            self._encoded_tokens += sum(len(a) for a in encoded)
            self._encoded_chars += sum(map(len, missing))
            fresh = dict(zip(missing, encoded, strict=True))
            return self._encode_parts(rest, array("I", known), fresh)
        finally:
            for piece in missing:
                if self._encoding.get(piece) is done:
                    del self._encoding[piece]
            done.set_result(None)

    def encoding(self, rest: list[str]) -> list[asyncio.Future[None]]:
        """The encodes on the thread (complete_async) of pieces of `rest`: once they are
        done those pieces are cached, as they would have been had the encode run on the
        loop before anything else (a request sharing the new text waits for them, not
        every request)."""
        pending = self._encoding
        if not pending:
            return []
        found = {id(f): f for p in rest[0::2] if (f := pending.get(p)) is not None}
        return list(found.values())

    def start_thread(self) -> None:
        """Start complete_async's thread now (else on first use). Its first batch call
        starts the tokenizer's own thread pool, which does the encoding without the GIL, at
        a lower CPU priority than the event loop (Linux threads inherit their creator's
        nice value): background work. The thread itself then goes back to the loop's
        priority where it may: it takes the GIL, and a low-priority thread preempted while
        holding it would stall the loop."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                1, thread_name_prefix="encode", initializer=self._background_pool
            )
            self._pool.submit(self._encode_batch, ["warm up", "the pool"]).result()

    def _background_pool(self) -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            self._tok.encode_batch(["start", "the pool"], add_special_tokens=False)
            os.setpriority(os.PRIO_PROCESS, tid, before)  # EPERM unless allowed: stays nice

    def close(self) -> None:
        """Stop complete_async's thread, if it was started."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def estimate_tokens(self, rest: list[str]) -> int:
        """About how many tokens `rest` holds, before encoding it: its characters at the
        rate this encoder's text has encoded at so far (4 a token before any), and its
        added tokens."""
        chars = sum(len(s) for s in rest[0::2])
        return int(chars / self.chars_per_token) + sum(1 for s in rest[1::2] if s)

    @property
    def chars_per_token(self) -> float:
        """Characters per token over the pieces encoded so far (4.0 before any)."""
        if self._encoded_tokens < 64:
            return 4.0
        return self._encoded_chars / self._encoded_tokens

    def prime(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> array | None:
        """Cache the pieces of a chat as it will be resent (no generation prompt): called with
        a finished answer appended, so the next turn finds its history already encoded.
        Returns the chat's ids (the next turn's prefix), None when nothing is cached."""
        if self._pattern is None:
            return None
        return self._encode_parts(self._chat_parts(messages, False, tools))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Equal to `ChatTokenizer.encode(text, add_special_tokens)` (text prompts)."""
        return self._encode(text, add_special_tokens).tolist()

    def stats(self) -> dict[str, Any]:
        """Counters: piece hits (served from cache) and misses (pieces encoded), cache size."""
        return {
            "mode": self.mode,
            "cuts": self.cuts,
            "render": self.renderer.reason or "by substitution",
            "render_hits": self.renderer.hits,
            "render_builds": self.renderer.builds,
            "text_prompts": "full encode" if self._special is None else self.mode,
            "calls": self._calls,
            "hits": self._hits,
            "misses": self._misses,
            "encoded_tokens": self._encoded_tokens,
            "cached_pieces": len(self._cache),
            "cached_tokens": self._cached_tokens,
            "max_cached_tokens": self.max_cached_tokens,
            "evictions": self._evictions,
            "verified": self._verified,
            "mismatches": self._mismatches,
            "guesses": self._guesses,
            "guessed_tokens": self._guessed_tokens,
            "guess_mismatches": self._guess_mismatches,
            "indexed_pieces": len(self.prefixes),
        }

    @property
    def special_ids(self) -> tuple[list[int], list[int]] | None:
        """The ids add_special_tokens=True puts before and after a text, None when the
        post-processor adds no fixed prefix and suffix."""
        if self._special is None:
            return None
        return self._special[0].tolist(), self._special[1].tolist()

    def clear(self) -> None:
        self._cache.clear()
        self._cached_tokens = 0
        self.settle()
        self.prefixes.clear()

    # -- encoding -------------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> array:
        self._calls += 1
        special = self._special if add_special_tokens else _NO_SPECIAL
        if self._pattern is None or special is None:
            return _token_ids_array(self._full(text, add_special_tokens))
        ids = self._encode_pieces(text)
        prefix, suffix = special
        if prefix or suffix:
            ids = prefix + ids + suffix
        if self.verify_every > 0 and self._calls % self.verify_every == 0:
            self._verified += 1
            full = self._full(text, add_special_tokens)
            if ids.tolist() != full:
                self._mismatches += 1
                log.error(
                    "CachedEncoder mismatch #%d on a %d-char text: %d ids cached, %d full",
                    self._mismatches,
                    len(text),
                    len(ids),
                    len(full),
                )
                return _token_ids_array(full)
        return ids

    def _full(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _chat_parts(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
    ) -> list[str]:
        """`_split` of the rendered chat: from its fixed parts, split once per shape, and
        its contents where that is exact (shared.chat_pieces), else from its text."""
        renderer, splitter = self.renderer, self._splitter
        fixed = renderer.fixed(messages, add_generation_prompt, tools) if splitter else None
        if fixed is None or splitter is None:
            return self._split(renderer.render(messages, add_generation_prompt, tools))
        renderer.hits += 1
        contents = [m["content"] for m in messages]
        parts = splitter.parts(fixed, contents)
        return self._split(join_fixed(fixed, contents)) if parts is None else self._cut_long(parts)

    def _split(self, text: str) -> list[str]:
        """Alternating [piece, added token, piece, ..., piece]; pieces may be empty. A long
        piece comes as its chunks with `CUT` between them, when cuts are safe here."""
        if self._pattern is None:  # no added tokens to split at
            return [text]
        parts = self._pattern.split(text)
        npattern = self._npattern
        if npattern is not None:
            out: list[str] = []  # stage 2: normalized added tokens, inside the pieces
            for i, s in enumerate(parts):
                if i & 1:
                    out.append(s)
                else:
                    out.extend(npattern.split(s))  # itself alternating, odd length
            parts = out
        return self._cut_long(parts)

    def _cut_long(self, parts: list[str]) -> list[str]:
        """`parts` with each long piece as its chunks, `CUT` between them (when cuts are
        safe here)."""
        if CUT not in self._added_arrays or all(len(s) <= CUT_CHARS for s in parts[0::2]):
            return parts
        cut: list[str] = []
        for i, s in enumerate(parts):
            if i & 1 or len(s) <= CUT_CHARS:
                cut.append(s)
                continue
            for j, chunk in enumerate(cut_text(s, CUT_CHARS)):
                cut.extend((CUT, chunk) if j else (chunk,))
        return cut

    def _encode_pieces(self, text: str) -> array:
        return self._encode_parts(self._split(text))

    def _missing(self, pieces: list[str], encoded: dict[str, array] | None = None) -> list[str]:
        """The distinct non-empty pieces neither cached nor in `encoded`, in order."""
        cache, known = self._cache, encoded or {}
        return [p for p in dict.fromkeys(pieces) if p and p not in cache and p not in known]

    def _encode_parts(
        self, parts: list[str], out: array | None = None, encoded: dict[str, array] | None = None
    ) -> array:
        """Ids of alternating [piece, added token, piece, ...], appended to `out`; `encoded`:
        pieces already encoded (on a thread), cached here."""
        cache = self._cache
        missing = self._missing(parts[0::2], encoded)
        fresh: dict[str, array] = {"": array("I"), **(encoded or {})}
        if missing:
            ends = _piece_ends(parts)
            fresh.update(zip(missing, self._encode_many(missing, ends), strict=True))
            self._misses += len(missing)
        added = self._added_arrays
        out = array("I") if out is None else out
        extend = out.extend
        touch = cache.move_to_end
        hits = 0
        for i, s in enumerate(parts):
            if i & 1:
                extend(added[s])
            else:
                ids = fresh.get(s)
                if ids is None:
                    ids = cache[s]
                    touch(s)
                    hits += 1
                extend(ids)
        self._hits += hits
        stored = [(p, fresh[p]) for p in missing if self._store(p, fresh[p])]
        stored += [(p, ids) for p, ids in (encoded or {}).items() if self._store(p, ids)]
        if stored and self.on_store is not None:
            self.on_store(stored)
        return out

    def _encode_many(self, pieces: list[str], ends: set[str] | None = None) -> list[array]:
        if len(pieces) == 1 or self._pool is not None:
            # one by one with a background thread: a batch would wait for the tokenizer's
            # thread pool, which runs at that thread's lower priority
            encode = self._tok.encode
            encodings = [encode(p, add_special_tokens=False) for p in pieces]
        else:  # one call, encoded in parallel by the Rust side
            encodings = self._encode_batch(pieces, ends)
        out = [_token_ids_array(e.ids) for e in encodings]
        self._encoded_tokens += sum(len(a) for a in out)
        self._encoded_chars += sum(map(len, pieces))
        self._index(pieces, out, encodings, ends)
        return out

    def _indexed(self, piece: str, ends: set[str] | None) -> bool:
        """Whether `piece` goes into the prefix index (`ends`: None, any long piece; else
        only those in it, the first and last chunks of their pieces: `_piece_ends`)."""
        return (
            self.prefixes.max_tokens > 0
            and len(piece) >= MIN_CHARS
            and (ends is None or piece in ends)
        )

    def _encode_batch(self, pieces: list[str], ends: set[str] | None = None) -> list[Any]:
        """The encodings of `pieces` in batch calls, which release the GIL while they
        encode (a thread may run them; they touch no state of this object). Their ids are
        read on the loop (`_ids_of`): that takes the GIL for a while, which a thread of
        lower priority could hold while preempted. With offsets (about a quarter of the
        encode's time) for the pieces to index (`_indexed`), the others without."""
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        indexed = [self._indexed(p, ends) for p in pieces]
        if not any(indexed):
            return list(fast(pieces, add_special_tokens=False))
        if all(indexed):
            return list(self._tok.encode_batch(pieces, add_special_tokens=False))
        to_index = [p for p, i in zip(pieces, indexed, strict=True) if i]
        others = [p for p, i in zip(pieces, indexed, strict=True) if not i]
        with_offsets = iter(self._tok.encode_batch(to_index, add_special_tokens=False))
        without = iter(fast(others, add_special_tokens=False))
        return [next(with_offsets) if i else next(without) for i in indexed]

    def _index(
        self,
        pieces: list[str],
        ids: list[array],
        encodings: list[Any],
        ends: set[str] | None = None,
    ) -> None:
        """Long pieces go into the prefix index (a later piece sharing their start is
        guessed from them), their tokens' ends read at once outside an event loop, else
        soon (`SETTLE_DELAY_S`). Of a piece cut in chunks only its first and last chunks
        (`ends`): a text parting from it within a middle chunk has the chunks before
        known exactly. Pieces encoded without offsets are skipped."""
        added = False
        if not self.prefixes.max_tokens:
            return
        for piece, piece_ids, encoding in zip(pieces, ids, encodings, strict=True):
            if self._indexed(piece, ends):
                self.prefixes.add(piece, piece_ids, encoding)
                added = True
        if not added:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.prefixes.unsettled > MAX_UNSETTLED:
            self.settle()
        elif self._settle_timer is None:
            self._settle_timer = loop.call_later(SETTLE_DELAY_S, self.settle)

    def settle(self) -> None:
        """Read the tokens' ends of the pieces indexed lately now (`PrefixIndex.settle`)."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        self.prefixes.settle()

    @staticmethod
    def _ids_of(encodings: list[Any]) -> list[array]:
        return [_token_ids_array(e.ids) for e in encodings]

    def adopt(self, pieces: Sequence[tuple[str, array]], ends: Sequence[array | None] = ()) -> None:
        """Cache pieces another process encoded (not passed to `on_store` again); `ends`:
        the token ends of those it indexed (`prefixes`), None for the others."""
        for piece, ids in pieces:
            self._store(piece, ids)
        for (piece, ids), piece_ends in zip(pieces, ends, strict=False):
            if piece_ends is not None:
                self.prefixes.add(piece, ids, piece_ends)

    def _store(self, piece: str, ids: array) -> bool:
        """Cache one piece; False when it is cached already or too large to be."""
        if len(ids) > self.max_cached_tokens or piece in self._cache:
            return False
        self._cache[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.max_cached_tokens:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= len(old)
            self._evictions += 1
        return True

    def _piecewise_uncached(self, text: str) -> list[int]:
        out: list[int] = []
        for i, s in enumerate(self._split(text)):
            if i & 1:
                out.extend(self._added_arrays[s])
            elif s:
                out.extend(self._tok.encode(s, add_special_tokens=False).ids)
        return out

    # -- setup ----------------------------------------------------------------------------

    def _setup(self) -> str | None:
        """Build the split patterns; the reason piece-wise encoding is unsafe, if any."""
        tok = self._tok
        if tok.truncation is not None or tok.padding is not None:
            return "truncation or padding is set on the tokenizer"
        if getattr(tok, "encode_special_tokens", False):
            return "encode_special_tokens is on (special tokens are not split out)"
        config = json.loads(tok.to_str())
        model = config.get("model") or {}
        if model.get("dropout"):
            return "BPE dropout makes encodes nondeterministic"
        if '"prepend_scheme": "first"' in json.dumps(config.get("pre_tokenizer")):
            return 'Metaspace prepend_scheme="first" depends on the position in the text'
        added = tok.get_added_tokens_decoder()
        if not added:
            return "the tokenizer has no added tokens to split at"
        raw: list[str] = []
        normalized: list[str] = []
        for token_id, token in added.items():
            if not token.content:
                continue
            if token.lstrip or token.rstrip or token.single_word:
                return (
                    f"added token {token.content!r} has lstrip={token.lstrip} "
                    f"rstrip={token.rstrip} single_word={token.single_word}"
                )
            (normalized if token.normalized else raw).append(token.content)
            self._added_arrays[token.content] = array("I", [token_id])
        if normalized and _normalizes(config.get("normalizer")):
            return "normalized added tokens are matched on normalizer output"
        if not raw and not normalized:
            return "the tokenizer has no added tokens to split at"
        self._pattern = _alternation(raw)
        self._npattern = _alternation(normalized) if normalized else None
        splitter = PieceSplitter(self._pattern, raw)  # (normalized added tokens: only the
        usable = splitter.usable and self._npattern is None  # text's own split finds them)
        self._splitter = splitter if usable else None
        return None

    def _self_test(self) -> str | None:
        """Piece-wise equals full on probe texts around every added token, or why not."""
        probes = list(_PROBES)
        for content in self._added_arrays:
            probes.append(f"x{content}y {content} \n{content}\n\n{content}{content}  z  ")
        probes.append(" ".join(probes))
        for text in probes:
            if self._piecewise_uncached(text) != self._full(text, False):
                return f"self-test failed on {text[:60]!r}"
        return None

    def _cut_test(self) -> str | None:
        """Chunks cut where `cut_text` cuts encode as the whole text does, on probe texts cut
        at every place it may cut (letters of several scripts, marks, contractions), or why
        not: the cut must begin a pre-token, which needs a pre-tokenizer that splits words
        apart and no normalizer running over the whole text."""
        if _normalizes(json.loads(self._tok.to_str()).get("normalizer")):
            return "a normalizer runs over the whole text"
        if self._tok.pre_tokenizer is None:
            return "no pre-tokenizer splits the words apart"
        words = (
            "The quick brown fox don't panic it's x y naïve café résumé Ünïcödé 中文 テキスト"
            " Δέλτα Привет مرحبا e\u0301t\u00e9 ok a1 b2 z"
        )
        probes = [words, f"  {words}  ", f"{words}\n{words}\t{words}", *_PROBES]
        for text in probes:
            chunks = cut_text(text, 1)
            joined: list[int] = []
            for chunk in chunks:
                joined += self._full(chunk, False)
            if joined != self._full(text, False):
                return f"cut-test failed on {text[:60]!r}"
        return None

    def _setup_special_tokens(self) -> None:
        """The post-processor's ids (add_special_tokens=True) as a fixed prefix and suffix."""
        tok = self._tok
        n = tok.num_special_tokens_to_add(False)
        probes = ["Hello world", *_PROBES]
        plain = tok.encode(probes[0], add_special_tokens=False).ids
        full = tok.encode(probes[0], add_special_tokens=True).ids
        for k in range(n + 1):
            if len(full) == len(plain) + n and full[k : k + len(plain)] == plain:
                prefix, suffix = full[:k], full[k + len(plain) :]
                if all(
                    tok.encode(p, add_special_tokens=True).ids
                    == prefix + tok.encode(p, add_special_tokens=False).ids + suffix
                    for p in probes
                ):
                    self._special = array("I", prefix), array("I", suffix)
                    return
        log.warning(
            "CachedEncoder: the post-processor is no fixed prefix/suffix: text prompts "
            "with add_special_tokens=True get full encodes"
        )


def _piece_ends(parts: list[str]) -> set[str]:
    """Of alternating [piece, added token, ...] (`CachedEncoder._split`), the first and
    last chunk of every piece cut in chunks (`CUT` between them) and every uncut piece:
    where a later text may part from it with nothing known before (a first chunk) or
    where a text that continues it parts (a last chunk)."""
    out: set[str] = set()
    n = len(parts)
    for i in range(0, n, 2):
        if (i == 0 or parts[i - 1] != CUT) or (i + 1 >= n or parts[i + 1] != CUT):
            out.add(parts[i])
    return out


def cut_text(text: str, every: int) -> list[str]:
    """`text` in chunks of `every` characters or more (the last may be shorter), each cut
    right before a space between two letters: where a byte-level BPE pre-tokenizer always
    splits (the space begins the next word's pre-token), so the chunks encode as the text
    does. A cut depends only on the text up to the character after it, not on where the text
    ends: a text and a longer one that continues it (a document, then the document and a
    question) are cut alike up to the first one's last cut, and share every chunk but its
    last."""
    chunks: list[str] = []
    start, last = 0, len(text) - 1  # a cut needs a letter after its space
    at = every
    while at < last:
        cut = text.find(" ", at, last)
        while cut > 0 and not (text[cut - 1].isalpha() and text[cut + 1].isalpha()):
            cut = text.find(" ", cut + 1, last)
        if cut <= 0:
            break
        chunks.append(text[start:cut])
        start, at = cut, cut + every
    chunks.append(text[start:])
    return chunks


def _normalizes(normalizer: dict[str, Any] | None) -> bool:
    """Whether a tokenizer.json normalizer changes text: an empty Sequence does not
    (DeepSeek's tokenizers carry one)."""
    if not normalizer:
        return False
    if normalizer.get("type") == "Sequence":
        return any(_normalizes(n) for n in normalizer.get("normalizers") or ())
    return True


def _alternation(contents: list[str]) -> re.Pattern[str]:
    """One capturing alternation, longest first: Python's leftmost-first = leftmost-longest."""
    ordered = sorted(set(contents), key=lambda c: (-len(c), c))
    return re.compile("(" + "|".join(re.escape(c) for c in ordered) + ")")

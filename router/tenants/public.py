"""Public prefixes: texts every tenant may share (a tool list, a system prompt), found at the
start of a request and counted in the engine's tokens, so that the engine caches those pages
once for everyone and salts only what follows (`shared_prefix_tokens`, router.tenants)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from router.request import CHAT, COMPLETIONS, GENERATE
from router.tenants.config import PublicPrefix, TenantsError, sha
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)

# Texts after a public text prefix: its tokens are counted up to where none of these merges
# with its end (a tokenizer's pieces rarely reach across more than one boundary token).
_PROBES = ("a", " a", "A", "1", " 1", ".", "\n", " ", "\u4e2d", "\n\n")


class PublicPrefixes:
    """The public prefixes of a tenants file, indexed, and their token counts."""

    def __init__(self, public: list[PublicPrefix], encoder: CachedEncoder | None) -> None:
        """Index the public prefixes: a chat's system message by its SHA-256; a text
        prompt's start by its length, then SHA-256; their token counts as far as known.
        TenantsError without a tokenizer to count them."""
        self.encoder = encoder
        chats: dict[str, PublicPrefix] = {}
        texts: dict[int, dict[str, PublicPrefix]] = {}
        ids: list[tuple[tuple[int, ...], int]] = []
        if public and self.encoder is None:
            raise TenantsError(
                "public_prefixes need the router's tokenizer (--tokenizer-path, or workers "
                "whose /get_model_info names a local one)"
            )
        for p in public:
            chats[p.sha256] = p
            if p.chars is not None:
                texts.setdefault(p.chars, {})[p.sha256] = p
        self._chat_index = chats
        self._text_index = sorted(texts.items(), reverse=True)  # longest first
        self._chat_tokens: dict[str, int] = {}
        self._text_tokens: dict[str, int] = {}
        for p in public:
            if p.text is not None:
                self._chat_tokens[p.sha256] = self._count_chat(p.text)
                self._text_tokens[p.sha256] = n = self._count_text(p.text)
                assert self.encoder is not None
                ids.append((tuple(self.encoder.encode(p.text)[:n]), n))
        self._id_prefixes = sorted(ids, key=lambda t: -t[1])

    def tokens(self, route: str, body: Mapping[str, Any]) -> int:
        """`shared_prefix_tokens` for this body: the public prefix it begins with, in the
        engine's tokens (0: none)."""
        if not self._chat_index:
            return 0
        if route == CHAT:
            return self._chat_public(body)
        prompt = body.get("prompt") if route == COMPLETIONS else body.get("text")
        if route == GENERATE and prompt is None:
            prompt = body.get("input_ids")
        if isinstance(prompt, str):
            return self._text_public(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self._ids_public(prompt)
        return 0  # batches: no public prefix (each prompt would need its own)

    def _chat_public(self, body: Mapping[str, Any]) -> int:
        messages = body.get("messages")
        if body.get("tools") or not isinstance(messages, list) or not messages:
            return 0  # tools: templates render them into the system block
        first = messages[0]
        if not isinstance(first, dict) or first.get("role") != "system":
            return 0
        content = first.get("content")
        if not isinstance(content, str) or not content:
            return 0  # parts: a template may render them otherwise than the string
        digest = sha(content)
        if digest not in self._chat_index:
            return 0
        n = self._chat_tokens.get(digest)
        if n is None:  # given by hash: counted the first time it is seen
            n = self._chat_tokens[digest] = self._count_chat(content)
        return n

    def _text_public(self, prompt: str) -> int:
        for chars, by_hash in self._text_index:
            if len(prompt) < chars:
                continue
            p = by_hash.get(sha(prompt[:chars]))
            if p is not None:
                n = self._text_tokens.get(p.sha256)
                if n is None:
                    n = self._text_tokens[p.sha256] = self._count_text(prompt[:chars])
                return n
        return 0

    def _ids_public(self, ids: list[Any]) -> int:
        for prefix, n in self._id_prefixes:
            if n and len(ids) >= n and tuple(ids[:n]) == prefix:
                return n
        return 0

    def _count_chat(self, content: str) -> int:
        """Tokens of a system message as the chat template renders it, to the end of that
        message (0 when the template does not render it as a prefix of a longer chat)."""
        encoder = self.encoder
        assert encoder is not None
        system = {"role": "system", "content": content}
        try:
            alone = encoder.renderer.render([system], False, None)
            longer = encoder.renderer.render([system, {"role": "user", "content": "?"}], True, None)
        except (ValueError, TypeError) as exc:
            log.warning("a public system message cannot be rendered: %s", exc)
            return 0
        if not longer.startswith(alone):
            log.warning("the chat template does not render a system message as a prefix")
            return 0
        return len(encoder.encode(alone, add_special_tokens=False))

    def _count_text(self, text: str) -> int:
        """Tokens of a text prompt's public start: as far as its ids stay the same whatever
        follows it (the last piece may merge with the next text's)."""
        encoder = self.encoder
        assert encoder is not None
        base = encoder.encode(text)
        n = len(base)
        for probe in _PROBES:
            more = encoder.encode(text + probe)
            same = 0
            for a, b in zip(base, more, strict=False):
                if a != b:
                    break
                same += 1
            n = min(n, same)
        return n

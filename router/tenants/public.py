"""Public prefixes: texts every tenant may share (a tool list, a system prompt), found at the
start of a request and counted in the engine's tokens, so that the engine caches those pages
once for everyone and salts only what follows (`shared_prefix_tokens`, router.tenants)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.request import CHAT, COMPLETIONS, GENERATE
from router.tenants.config import PublicPrefix, TenantsError, sha
from shared.token_cache import CachedEncoder

log = logging.getLogger(__name__)

# Texts after a public text prefix: its tokens are counted up to where none of these merges
# with its end (a tokenizer's pieces rarely reach across more than one boundary token).
_PROBES = ("a", " a", "A", "1", " 1", ".", "\n", " ", "\u4e2d", "\n\n")


@dataclass(slots=True)
class _Counts:
    """The public prefixes' token counts in one tokenizer's ids."""

    encoder: CachedEncoder  # held: its id() keys these counts
    chat: dict[str, int] = field(default_factory=dict)  # by the system message's SHA-256
    text: dict[str, int] = field(default_factory=dict)  # by the text start's SHA-256
    ids: list[tuple[tuple[int, ...], int]] = field(default_factory=list)  # longest first


class PublicPrefixes:
    """The public prefixes of a tenants file, indexed, and their token counts in each
    served model's tokenizer: the engine salts what follows `shared_prefix_tokens` of its
    own tokens, and a count from another tokenizer than the request's model's would start
    the salt past the public text (sharing private tokens) or before it (sharing nothing)."""

    def __init__(self, public: list[PublicPrefix], encoder: CachedEncoder | None) -> None:
        """Index the public prefixes: a chat's system message by its SHA-256; a text
        prompt's start by its length, then SHA-256; their token counts in `encoder`'s ids
        (the default model's) as far as known. TenantsError without a tokenizer to count
        them."""
        self.encoder = encoder
        chats: dict[str, PublicPrefix] = {}
        texts: dict[int, dict[str, PublicPrefix]] = {}
        if public and self.encoder is None:
            raise TenantsError(
                "public_prefixes need the router's tokenizer (--tokenizer-path, or workers "
                "whose /get_model_info names a local one)"
            )
        for p in public:
            chats[p.sha256] = p
            if p.chars is not None:
                texts.setdefault(p.chars, {})[p.sha256] = p
        self._public = public
        self._chat_index = chats
        self._text_index = sorted(texts.items(), reverse=True)  # longest first
        self._counts: dict[int, _Counts] = {}
        if encoder is not None and public:
            self._counted(encoder)

    def tokens(self, route: str, body: Mapping[str, Any], encoder: CachedEncoder | None) -> int:
        """`shared_prefix_tokens` for this body: the public prefix it begins with, in
        `encoder`'s tokens (the request's model's), 0 for none; a model with no tokenizer
        here (None) shares nothing, as its tokens cannot be counted."""
        if not self._chat_index or encoder is None:
            return 0
        counts = self._counted(encoder)
        if route == CHAT:
            return self._chat_public(body, counts)
        prompt = body.get("prompt") if route == COMPLETIONS else body.get("text")
        if route == GENERATE and prompt is None:
            prompt = body.get("input_ids")
        if isinstance(prompt, str):
            return self._text_public(prompt, counts)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self._ids_public(prompt, counts)
        return 0  # batches: no public prefix (each prompt would need its own)

    def _counted(self, encoder: CachedEncoder) -> _Counts:
        """`encoder`'s counts, made the first time it is asked for (the prefixes given by
        text at once; those given by hash when a request first shows them)."""
        counts = self._counts.get(id(encoder))
        if counts is None:
            counts = self._counts[id(encoder)] = _Counts(encoder)
            for p in self._public:
                if p.text is not None:
                    counts.chat[p.sha256] = self._count_chat(p.text, encoder)
                    counts.text[p.sha256] = n = self._count_text(p.text, encoder)
                    counts.ids.append((tuple(encoder.encode(p.text)[:n]), n))
            counts.ids.sort(key=lambda t: -t[1])
        return counts

    def _chat_public(self, body: Mapping[str, Any], counts: _Counts) -> int:
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
        n = counts.chat.get(digest)
        if n is None:  # given by hash: counted the first time it is seen
            n = counts.chat[digest] = self._count_chat(content, counts.encoder)
        return n

    def _text_public(self, prompt: str, counts: _Counts) -> int:
        for chars, by_hash in self._text_index:
            if len(prompt) < chars:
                continue
            p = by_hash.get(sha(prompt[:chars]))
            if p is not None:
                n = counts.text.get(p.sha256)
                if n is None:
                    n = counts.text[p.sha256] = self._count_text(prompt[:chars], counts.encoder)
                return n
        return 0

    @staticmethod
    def _ids_public(ids: list[Any], counts: _Counts) -> int:
        for prefix, n in counts.ids:
            if n and len(ids) >= n and tuple(ids[:n]) == prefix:
                return n
        return 0

    @staticmethod
    def _count_chat(content: str, encoder: CachedEncoder) -> int:
        """Tokens of a system message as the chat template renders it, to the end of that
        message (0 when the template does not render it as a prefix of a longer chat)."""
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

    @staticmethod
    def _count_text(text: str, encoder: CachedEncoder) -> int:
        """Tokens of a text prompt's public start: as far as its ids stay the same whatever
        follows it (the last piece may merge with the next text's)."""
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

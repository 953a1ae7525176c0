"""Reading an inference request: the JSON body, the model, the prompt as the engine sees it.

Plain functions that return a `RouteRequest` (what policies look at) or raise `RequestError`
(a 4xx the router answers before any worker is touched), so they run and are tested without
an app. Tokenizing costs milliseconds on long prompts, so only token-routing policies pay
for it; a prompt's text the router never encoded (a chat's new messages, a text prompt's
new chunks) is left in `rest`, to be encoded once the request has gone. Where that text
begins as text encoded before (a document with a new question), the policies see its likely
ids (`Known.guess`, counted in `RouteRequest.guessed`); the exact ids replace them once
encoded, and only those are recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from router.policies import RouteRequest
from shared.namespaces import CacheNamespace, namespace_fields
from shared.token_cache import CachedEncoder, Known

_json_decode = msgspec.json.Decoder().decode
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
INFERENCE_ROUTES = (GENERATE, CHAT, COMPLETIONS)


class RequestError(Exception):
    """A request the router refuses; becomes a JSON error with this status."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else."""
    try:
        body = _json_decode(raw)
    except msgspec.DecodeError as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


ROUTER_FIELDS = ("memserve",)  # what the router tells workers; never taken from a client


def without_router_fields(body: dict[str, Any], raw: bytes) -> bytes:
    """The body as a worker may get it from a client: a client's own `memserve` hint (which
    holders to pull a prefix from) is dropped, or it could aim a worker's MemPool
    connections at any address."""
    if not any(f in body for f in ROUTER_FIELDS):
        return raw
    for f in ROUTER_FIELDS:
        body.pop(f, None)
    return msgspec.json.encode(body)


def check_model(body: Mapping[str, Any], served: set[str]) -> None:
    """404 for a model no worker serves ('default' and no model at all always pass)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise RequestError(400, "'model' must be a string")
    if not served or model in served or model == "default":
        return
    base = model.split(":", 1)[0]  # SGLang's base:adapter (the worker knows its adapters)
    if base != model and (base in served or base == "default"):
        return
    raise RequestError(404, f"model {model!r} not found; served: {sorted(served)}")


_NS_FIELDS = ("cache_salt", "extra_key", "lora_path", "shared_prefix_tokens")


def cache_namespace(body: Mapping[str, Any], model_key: str = "") -> CacheNamespace | None:
    """The cache namespace the body names (`cache_salt`, `extra_key`, an adapter, and where
    a salt starts: `shared_prefix_tokens`), keyed as the workers key it, and in the router's
    trees under `model_key` (router.models: every model but the default one); None for
    none. 400 for a malformed field, as the worker would answer."""
    model = body.get("model")
    if not (isinstance(model, str) and ":" in model) and not any(f in body for f in _NS_FIELDS):
        # (most requests: no namespace, and no parse)
        return CacheNamespace(model=model_key) if model_key else None
    try:
        fields = namespace_fields(body)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None
    if not fields.any and not model_key:
        return None
    return CacheNamespace.named(
        fields.extra_key, fields.adapter, fields.cache_salt, fields.shared_prefix_tokens, model_key
    )


def session_key(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """`X-Session-Id`, else the OpenAI `user` field: what the session policy sticks to."""
    user = body.get("user")
    return headers.get("X-Session-Id") or (user if isinstance(user, str) else None)


def route_request(
    route: str,
    body: Mapping[str, Any],
    encoder: CachedEncoder | None,
    want_text: bool = True,
    model_key: str = "",
) -> RouteRequest:
    """The prompt of `body` for the policies: uint32 token ids (when `encoder` is given),
    the raw text (a chat's joined only when `want_text`: cache_aware's character tree), and
    a chat's normalized messages, keyed under `model_key` (router.models). Malformed
    prompts are 400 whatever the policy."""
    namespace = cache_namespace(body, model_key)
    if route == CHAT:
        request = _chat(body, encoder, want_text)
    elif route == COMPLETIONS:
        request = _completion(body, encoder)
    else:
        request = _generate(body, encoder)
        if want_text and not request.text and request.tokens is not None:
            request.text = " ".join(map(str, request.tokens))  # sglang-router's tree sees ids
    if namespace is not None:
        request.namespace = namespace
        if request.text:  # a character tree's prefix is kept apart too (the whole prompt)
            request.text = f"\0{namespace_tag(namespace)}\0{request.text}"
    return request


def namespace_tag(namespace: CacheNamespace) -> str:
    """A short name of a namespace for text trees (the salt and keys, hashed)."""
    parts: tuple[str, ...] = (namespace.extra_key, namespace.lora_id, namespace.cache_salt or "")
    if namespace.model:
        parts += (namespace.model,)
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _chat(body: Mapping[str, Any], encoder: CachedEncoder | None, want_text: bool) -> RouteRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list")
    parts: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_parts(content, i)
        if content is not None and not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string or parts")
        parts.append(m if isinstance(m.get("content"), str) else {**m, "content": content or ""})
    text = "".join(p["content"] for p in parts) if want_text else ""
    if encoder is None:
        return RouteRequest(None, text, None, chat=parts)
    try:
        known = encoder.encode_chat_known(parts, tools=body.get("tools"))
    except (ValueError, TypeError) as exc:  # a template error, or text no tokenizer takes
        raise RequestError(400, f"cannot apply the chat template: {exc}") from None
    return _known_request(RouteRequest(known.ids, text, None, chat=parts), known, encoder)


def _known_request(request: RouteRequest, known: Known, encoder: CachedEncoder) -> RouteRequest:
    """`request` with the rest of its prompt left to encode, and the guess of its start
    appended to its ids (the guess counted in the estimate of the rest's tokens)."""
    request.rest = known.rest or None
    request.rest_tokens = encoder.estimate_tokens(known.rest)
    if known.guess:
        ids = request.tokens
        assert isinstance(ids, array)
        ids.extend(known.guess)  # known.ids: a fresh array of this request's
        request.guessed = len(known.guess)
        request.rest_tokens = max(request.rest_tokens - request.guessed, 1)
    return request


def _text_parts(parts: list[Any], i: int) -> str:
    """OpenAI content parts as the text they carry (parts without text add nothing)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise RequestError(400, f"messages[{i}].content[{j}] must be an object")
        text = part.get("text", "")
        if not isinstance(text, str):
            raise RequestError(400, f"messages[{i}].content[{j}].text must be a string")
        texts.append(text)
    return "".join(texts)


def _completion(body: Mapping[str, Any], encoder: CachedEncoder | None) -> RouteRequest:
    prompt = body.get("prompt")
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return RouteRequest(token_ids("prompt", prompt), " ".join(map(str, prompt)), None)
    if not isinstance(prompt, str):
        raise RequestError(400, "'prompt' must be a string or a list of token ids")
    return _text(encoder, prompt)


def _generate(body: Mapping[str, Any], encoder: CachedEncoder | None) -> RouteRequest:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError(400, "give exactly one of 'text' or 'input_ids'")
    # A batch (SGLang accepts lists of prompts) routes by its first prompt.
    if isinstance(text, list):
        if not text or not all(isinstance(t, str) for t in text):
            raise RequestError(400, "'text' must be a string or a non-empty list of strings")
        text = text[0]
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if ids is not None:
        return RouteRequest(token_ids("input_ids", ids), "", None)
    if not isinstance(text, str):
        raise RequestError(400, "'text' must be a string")
    return _text(encoder, text)


def _text(encoder: CachedEncoder | None, text: str) -> RouteRequest:
    """A text prompt as a chat's is read: its ids as far as the encoder has its pieces
    cached (a shared tool prompt or document, in chunks), the new text left in `rest`."""
    if encoder is None:
        return RouteRequest(None, text, None)
    try:
        known = encoder.encode_text_known(text)
        if known is None:  # this tokenizer's text prompts are encoded whole
            return RouteRequest(array("I", encoder.encode(text)), text, None)
    except (ValueError, TypeError) as exc:  # lone surrogates: text no tokenizer takes
        raise RequestError(400, f"cannot tokenize the prompt: {exc}") from None
    for piece in known.rest[0::2]:  # text no tokenizer takes is refused now, not after the send
        try:
            piece.encode()
        except UnicodeEncodeError as exc:
            raise RequestError(400, f"cannot tokenize the prompt: {exc}") from None
    return _known_request(RouteRequest(known.ids, text, None), known, encoder)


def token_ids(name: str, ids: Any) -> array[int]:
    """Client-given token ids as uint32; 400 unless a list of non-negative ints."""
    if not isinstance(ids, list) or any(isinstance(t, bool) for t in ids):
        raise RequestError(400, f"'{name}' must be a list of token ids")
    try:
        return array("I", ids)
    except (TypeError, OverflowError):
        raise RequestError(400, f"'{name}' must be a list of token ids") from None


def full_tokens(prompt: RouteRequest, encoder: CachedEncoder | None) -> array[int] | None:
    """The prompt's ids, encoding the text left for after the dispatch if not done yet."""
    tokens = prompt.tokens
    if tokens is None:
        return None
    known = tokens if isinstance(tokens, array) else array("I", tokens)
    if prompt.rest and encoder is not None:
        known, guess = exact_part(prompt, known)
        try:
            full = encoder.complete(known, prompt.rest)
        except (ValueError, TypeError):  # text no tokenizer takes: the engine refused it too
            prompt.tokens = prompt.rest = None
            prompt.guessed = 0
            return None
        if guess:
            encoder.check_guess(guess, full[len(known) : len(known) + len(guess)])
        known = full
        prompt.rest, prompt.rest_tokens, prompt.guessed = None, 0, 0
    prompt.tokens = known
    return known


def exact_part(prompt: RouteRequest, tokens: array[int]) -> tuple[array[int], array[int]]:
    """The prompt's exact ids and the guess after them (`_known_request`)."""
    n = prompt.guessed
    if not n:
        return tokens, array("I")
    cut = len(tokens) - n
    return tokens[:cut], tokens[cut:]


def when_encoded(
    prompt: RouteRequest,
    encoder: CachedEncoder | None,
    then: Callable[[array[int] | None], None],
) -> None:
    """`then(ids)` with the prompt's full ids (None: it has none): at once when little new
    text is left to encode, else once a thread has encoded it (a cold long prompt, whose
    encode would stall every other request on the loop for milliseconds). Whoever asks
    while that runs waits for the same encode."""
    if prompt.encoding is None:
        if not prompt.rest or encoder is None or not encoder.off_loop(prompt.rest):
            then(full_tokens(prompt, encoder))
            return
        prompt.encoding = asyncio.get_running_loop().create_task(_encode_rest(prompt, encoder))
    prompt.encoding.add_done_callback(lambda _: then(full_tokens(prompt, encoder)))


async def _encode_rest(prompt: RouteRequest, encoder: CachedEncoder) -> None:
    tokens, rest = prompt.tokens, prompt.rest
    if tokens is None or not rest:
        return
    known, guess = exact_part(prompt, tokens if isinstance(tokens, array) else array("I", tokens))
    try:
        full = await encoder.complete_async(known, rest)
    except (ValueError, TypeError):  # text no tokenizer takes: the engine refused it too
        prompt.tokens = None
    else:
        if guess:
            encoder.check_guess(guess, full[len(known) : len(known) + len(guess)])
        prompt.tokens = full
    prompt.rest, prompt.rest_tokens, prompt.guessed = None, 0, 0


def encoded(prompt: RouteRequest) -> bool:
    """False while the prompt's new text is being encoded on a thread."""
    return prompt.encoding is None or prompt.encoding.done()

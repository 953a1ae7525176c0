"""Reading inference requests without an app: bodies, models, prompts as the engine sees them."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import pytest

from router.request import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    RequestError,
    check_model,
    full_tokens,
    parse_json_object,
    route_request,
    session_key,
    without_router_fields,
)
from shared.token_cache import CachedEncoder
from shared.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> CachedEncoder:
    return CachedEncoder(ChatTokenizer(model_dir))


def refused(status: int, fn: Any, *args: Any) -> str:
    with pytest.raises(RequestError) as info:
        fn(*args)
    assert info.value.status == status
    return str(info.value)


@pytest.mark.parametrize(
    ("raw", "why"),
    [(b"{", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"\xff\xfe", "not valid JSON")],
)
def test_bodies_that_are_not_json_objects_are_400(raw: bytes, why: str) -> None:
    assert why in refused(400, parse_json_object, raw)


def test_models_no_worker_serves_are_404_and_defaults_pass() -> None:
    served = {"smollm2"}
    for body in ({}, {"model": "smollm2"}, {"model": "default"}):
        check_model(body, served)
    check_model({"model": "anything"}, set())  # nothing learned yet: nothing to refuse
    assert "not found" in refused(404, check_model, {"model": "gpt-9"}, served)
    assert "string" in refused(400, check_model, {"model": 7}, served)


def test_session_key_prefers_the_header_then_the_user_field() -> None:
    assert session_key({"X-Session-Id": "s1"}, {"user": "u"}) == "s1"
    assert session_key({}, {"user": "u"}) == "u"
    assert session_key({}, {"user": 3}) is None


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"messages": []}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"content": "x"}]}, "'role'"),
        ({"messages": [{"role": "user", "content": 5}]}, "string or parts"),
        ({"messages": [{"role": "user", "content": [{"text": False}]}]}, "text must be a str"),
        ({"messages": [{"role": "user", "content": ["hi"]}]}, "must be an object"),
        ({"model": {}, "messages": [{"role": "user", "content": "hi"}]}, "'model'"),
    ],
)
def test_malformed_chats_are_400_whatever_the_policy(body: dict[str, Any], why: str) -> None:
    def read(body: dict[str, Any]) -> None:
        check_model(body, {"smollm2"})
        route_request(CHAT, body, None)

    assert why in refused(400, read, body)


def test_text_no_tokenizer_takes_is_400(encoder: CachedEncoder) -> None:
    lone = "half a pair: \ud800"
    assert "tokenize" in refused(400, route_request, GENERATE, {"text": lone}, encoder)
    # A chat's new text is encoded after the send: the engine refuses it, and the router's
    # own late encode gives up quietly (nothing to learn) instead of raising in a callback.
    chat = route_request(CHAT, {"messages": [{"role": "user", "content": lone}]}, encoder)
    assert chat.rest and full_tokens(chat, encoder) is None


@pytest.mark.parametrize(
    ("route", "body", "why"),
    [
        (GENERATE, {}, "exactly one"),
        (GENERATE, {"text": "a", "input_ids": [1]}, "exactly one"),
        (GENERATE, {"text": []}, "non-empty list"),
        (GENERATE, {"text": 3}, "'text' must be a string"),
        (GENERATE, {"input_ids": [1, -2]}, "token ids"),
        (GENERATE, {"input_ids": [True]}, "token ids"),
        (COMPLETIONS, {"prompt": 3}, "string or a list of token ids"),
        (COMPLETIONS, {"prompt": [1, -1]}, "token ids"),
    ],
)
def test_malformed_prompts_are_400(route: str, body: dict[str, Any], why: str) -> None:
    assert why in refused(400, route_request, route, body, None)


def test_text_prompts_carry_their_text_and_ids_only_when_an_encoder_is_given(
    encoder: CachedEncoder,
) -> None:
    without = route_request(GENERATE, {"text": "hello there"}, None)
    assert without.tokens is None and without.text == "hello there"
    with_ids = route_request(GENERATE, {"text": "hello there"}, encoder)
    assert isinstance(with_ids.tokens, array)
    assert list(full_tokens(with_ids, encoder) or []) == encoder.encode("hello there")
    again = route_request(COMPLETIONS, {"prompt": "hello there"}, encoder)
    assert not again.rest and list(again.tokens or []) == encoder.encode("hello there")


def test_a_long_text_prompt_is_known_up_to_its_new_chunks(encoder: CachedEncoder) -> None:
    """A tool prompt or document resent with a new question: the router matches the trees
    with the chunks it encoded before and encodes only the new text, after the send."""
    shared = " ".join(f"word{i % 97} alpha beta" for i in range(3000))  # ~57K characters
    first = route_request(COMPLETIONS, {"prompt": shared + " first question"}, encoder)
    assert not first.tokens and first.rest  # never seen: all of it is new text
    whole = list(full_tokens(first, encoder) or [])
    assert whole == encoder.tokenizer.encode(shared + " first question")
    second = route_request(COMPLETIONS, {"prompt": shared + " second question"}, encoder)
    assert second.rest and len(second.tokens or []) > 0.9 * len(whole)  # only the last chunk
    assert abs(second.num_tokens - len(whole)) < 0.05 * len(whole)  # the rest estimated
    assert list(full_tokens(second, encoder) or []) == encoder.tokenizer.encode(
        shared + " second question"
    )


def test_a_batch_routes_by_its_first_prompt_and_ids_give_cache_aware_a_text() -> None:
    batch = route_request(GENERATE, {"input_ids": [[5, 6, 7], [8]]}, None)
    assert list(batch.tokens or []) == [5, 6, 7] and batch.text == "5 6 7"
    no_text = route_request(GENERATE, {"input_ids": [5, 6]}, None, want_text=False)
    assert no_text.text == ""
    first = route_request(GENERATE, {"text": ["first", "second"]}, None)
    assert first.text == "first"


def test_a_chat_is_known_in_part_then_completed_exactly(encoder: CachedEncoder) -> None:
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"text": "colour."}]},
    ]
    prompt = route_request(CHAT, {"messages": messages}, encoder)
    assert prompt.chat is not None and prompt.chat[1]["content"] == "Name a colour."
    assert prompt.text == "You are brief.Name a colour."
    assert prompt.rest and prompt.rest_tokens > 0  # never seen: left for after the send
    tokens = full_tokens(prompt, encoder)
    assert tokens is not None and prompt.rest is None and prompt.rest_tokens == 0
    assert list(tokens) == encoder.encode_chat(prompt.chat)
    again = route_request(CHAT, {"messages": messages}, encoder)
    assert again.rest is None and list(again.tokens or []) == list(tokens)  # all known now


def test_a_clients_own_pull_hint_never_reaches_a_worker() -> None:
    body = {"text": "hi", "memserve": {"prefix_holders": [{"host": "10.0.0.1", "port": 22}]}}
    raw = json.dumps(body).encode()
    cleaned = without_router_fields(body, raw)
    assert json.loads(cleaned) == {"text": "hi"} and "memserve" not in body
    plain = {"text": "hi"}
    raw = json.dumps(plain).encode()
    assert without_router_fields(plain, raw) is raw  # untouched bodies are not re-encoded

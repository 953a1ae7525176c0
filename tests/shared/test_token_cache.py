"""CachedEncoder gives exactly the engine's token ids (real SmolLM2 tokenizer), caching history."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import threading
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.token_cache import CUT_CHARS, CachedEncoder, cut_text
from shared.tokenizer import ChatTokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>"]
FRAGMENTS = [
    " ", "  ", "   ", "\n", "\n\n", "\t", " \n ", "\r\n", "\u00a0", "\u3000",
    *SPECIALS,
    "<|im_start", "im_end|>", "<|", "|>", "<", ">", "<|im_start|>user\n", "<|im_end|>\n",
    "\U0001f642", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u00e9", "e\u0301", "\u4e2d\u6587",
    "Hello", "world", "don't", "123456", "...", "def f(x):\n    return x",
]  # fmt: skip

fragment = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12))
content = st.lists(fragment, max_size=12).map("".join)
role = st.sampled_from(["system", "user", "assistant"])
message = st.fixed_dictionaries({"role": role, "content": content})

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer(model_dir)


@pytest.fixture(scope="module")
def shared(chat: ChatTokenizer) -> CachedEncoder:
    """One encoder across examples, so pieces cached by earlier examples get reused."""
    return CachedEncoder(chat)


def long_conversation(chat: ChatTokenizer, tokens: int) -> list[dict[str, str]]:
    source = (Path(__file__).parents[2] / "README.md").read_text()
    messages = [{"role": "system", "content": "You are a careful assistant."}]
    i = 0
    while len(chat.encode_chat(messages)) < tokens:
        start = (i * 997) % (len(source) - 1600)
        role_ = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role_, "content": f"{i}: " + source[start : start + 1500]})
        i += 1
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Go on."})
    return messages


def test_premise_holds_for_smollm2(shared: CachedEncoder) -> None:
    stats = shared.stats()
    assert stats["mode"] == "piecewise", stats["mode"]
    # SmolLM2's post-processor adds nothing: add_special_tokens=True changes no ids.
    assert shared.special_ids == ([], [])


@SETTINGS
@given(messages=st.lists(message, min_size=1, max_size=6), gen=st.booleans())
def test_encode_chat_equals_engine(
    chat: ChatTokenizer, shared: CachedEncoder, messages: list[dict[str, str]], gen: bool
) -> None:
    expected = chat.encode_chat(messages, add_generation_prompt=gen)
    assert shared.encode_chat(messages, add_generation_prompt=gen) == expected
    assert shared.encode_chat(messages, add_generation_prompt=gen) == expected  # all cached


@SETTINGS
@given(messages=st.lists(message, min_size=1, max_size=6), gen=st.booleans())
def test_known_part_then_the_rest_equals_engine(
    chat: ChatTokenizer, shared: CachedEncoder, messages: list[dict[str, str]], gen: bool
) -> None:
    """What a router matches before dispatch, then completes after: the engine's ids."""
    expected = chat.encode_chat(messages, add_generation_prompt=gen)
    known, rest, _ = shared.encode_chat_known(messages, add_generation_prompt=gen)
    assert known.tolist() == expected[: len(known)]  # a true prefix of the prompt
    assert shared.complete(known, rest).tolist() == expected
    if rest:
        assert shared.estimate_tokens(rest) > 0
    known, rest, _ = shared.encode_chat_known(messages, add_generation_prompt=gen)
    assert rest == [] and known.tolist() == expected  # everything is known now


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=st.lists(message, min_size=1, max_size=3),
    turns=st.lists(st.tuples(content, content), min_size=1, max_size=6),
    budget=st.sampled_from([50, 4_000_000]),
)
def test_multi_turn_equals_engine_on_every_turn(
    chat: ChatTokenizer,
    first: list[dict[str, str]],
    turns: list[tuple[str, str]],
    budget: int,
) -> None:
    encoder = CachedEncoder(chat, max_cached_tokens=budget)  # 50: eviction on every turn
    messages = list(first)
    for reply, question in turns:
        assert encoder.encode_chat(messages) == chat.encode_chat(messages)
        assert encoder.stats()["cached_tokens"] <= budget
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": question},
        ]
    assert encoder.encode_chat(messages) == chat.encode_chat(messages)


@SETTINGS
@given(text=content, special=st.booleans())
def test_text_prompt_encode_equals_engine(
    chat: ChatTokenizer, shared: CachedEncoder, text: str, special: bool
) -> None:
    assert shared.encode(text, add_special_tokens=special) == chat.encode(text, special)
    assert shared.encode(text) == chat.encode(text)


def test_turn_two_of_8k_conversation_encodes_only_new_messages(chat: ChatTokenizer) -> None:
    encoder = CachedEncoder(chat, verify_every=1)
    messages = long_conversation(chat, 8000)
    ids = encoder.encode_chat(messages)
    assert ids == chat.encode_chat(messages) and len(ids) >= 8000
    first = encoder.stats()
    assert first["encoded_tokens"] >= 7900  # turn 1 encodes nearly everything
    for turn in range(3):
        messages += [
            {"role": "assistant", "content": f"Answer {turn}: the history stays as it was."},
            {"role": "user", "content": f"Question {turn}: and <|im_start|> typed in text?  "},
        ]
        before = encoder.stats()
        assert encoder.encode_chat(messages) == chat.encode_chat(messages)
        after = encoder.stats()
        # Pieces encoded: the new assistant and user messages (the user's typed special
        # token splits it in two), nothing of the ~8K-token history.
        assert after["misses"] - before["misses"] <= 3
        assert after["encoded_tokens"] - before["encoded_tokens"] < 60
    assert encoder.stats()["verified"] == 4 and encoder.stats()["mismatches"] == 0


def test_a_cold_chat_encoded_on_a_thread_equals_engine(chat: ChatTokenizer) -> None:
    """A cold 8K chat's new text goes to the encoder's thread (the loop serves meanwhile);
    the ids are the engine's, and its pieces are cached for the next turn."""
    encoder = CachedEncoder(chat)
    messages = long_conversation(chat, 8000)
    known, rest, _ = encoder.encode_chat_known(messages)
    assert encoder.off_loop(rest)
    loop_thread = threading.get_ident()
    seen: set[int] = set()
    batch = encoder._encode_batch

    def spy(pieces: list[str], ends: set[str] | None = None) -> list[Any]:
        seen.add(threading.get_ident())
        return batch(pieces, ends)

    encoder._encode_batch = spy  # type: ignore[method-assign]

    async def encode() -> Any:
        task = asyncio.get_running_loop().create_task(encoder.complete_async(known, rest))
        await asyncio.sleep(0)  # on the thread now: a request sharing the text waits for it
        waits = encoder.encoding(rest)
        assert len(waits) == 1 and not waits[0].done()
        ids = await task
        assert waits[0].done() and encoder.encoding(rest) == []
        return ids

    try:
        ids = asyncio.run(encode())
    finally:
        encoder.close()
    assert ids.tolist() == chat.encode_chat(messages)
    assert seen and loop_thread not in seen
    known, rest, _ = encoder.encode_chat_known(messages)
    assert rest == [] and known == ids
    short = [*messages, {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "?"}]
    known, rest, _ = encoder.encode_chat_known(short)
    assert rest and not encoder.off_loop(rest)  # a new turn: encoded on the loop, at once
    assert asyncio.run(encoder.complete_async(known, rest)).tolist() == chat.encode_chat(short)


def test_primed_answer_leaves_only_the_new_question_to_encode(chat: ChatTokenizer) -> None:
    encoder = CachedEncoder(chat)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    encoder.encode_chat(messages)
    for turn in range(3):
        answer = {"role": "assistant", "content": f"Answer {turn}: a sky-blue  reply.\n"}
        encoder.prime([*messages, answer])  # what the router does once the answer passed
        messages += [answer, {"role": "user", "content": f"Question {turn}: and then?"}]
        before = encoder.stats()
        assert encoder.encode_chat(messages) == chat.encode_chat(messages)
        assert encoder.stats()["misses"] - before["misses"] == 1  # the new question only


def test_verify_every_catches_a_wrong_cache_entry(model_dir: Path) -> None:
    chat = ChatTokenizer(model_dir)  # its own: the test changes its vocabulary
    encoder = CachedEncoder(chat, verify_every=2)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    cached = encoder.encode_chat(messages)
    assert cached == chat.encode_chat(messages)
    chat.hf_tokenizer.add_tokens(["France"])  # the cached piece's ids are wrong from now on
    expected = chat.encode_chat(messages)
    assert expected != cached
    assert encoder.encode_chat(messages) == expected  # 2nd call verified: full encode wins
    assert encoder.stats()["mismatches"] == 1
    assert encoder.encode_chat(messages) == cached  # 3rd call not verified: the wrong entry


@pytest.mark.parametrize("flag", [{"lstrip": True}, {"rstrip": True}, {"single_word": True}, None])
def test_unsafe_tokenizers_fall_back_to_full_encodes(
    model_dir: Path, tmp_path: Path, flag: dict[str, bool] | None
) -> None:
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((model_dir / "tokenizer.json").read_text())
    if flag is None:
        config["added_tokens"] = []  # no added tokens: nothing to split at
    else:
        config["added_tokens"][2].update(flag)  # <|im_end|>
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    chat = ChatTokenizer(tmp_path)
    encoder = CachedEncoder(chat)
    assert encoder.stats()["mode"].startswith("full encode:")
    messages = [
        {"role": "user", "content": "  spaces  <|im_end|>  around "},
        {"role": "assistant", "content": "x<|im_end|>y"},
    ]
    for _ in range(2):
        assert encoder.encode_chat(messages) == chat.encode_chat(messages)
        assert encoder.encode("a <|im_end|> b") == chat.encode("a <|im_end|> b")
    assert encoder.stats()["cached_pieces"] == 0


def test_cuts_fall_between_two_letters_and_alike_in_a_common_prefix() -> None:
    text = "alpha beta, gamma  delta\tepsilon zeta-eta theta iota kappa lambda mu"
    chunks = cut_text(text, 8)
    assert "".join(chunks) == text and len(chunks) > 3
    for left, right in itertools.pairwise(chunks):
        assert right[0] == " " and left[-1].isalpha() and right[1].isalpha()
        assert len(left) >= 8
    other = cut_text(text[:40] + " and something else entirely", 8)

    def cuts(chunks: list[str]) -> set[int]:
        return {sum(map(len, chunks[:i])) for i in range(1, len(chunks))}

    # the cuts inside the common prefix are the same
    assert {c for c in cuts(other) if c < 39} == {c for c in cuts(chunks) if c < 39} != set()
    assert cut_text("no-spaces-here-at-all-" * 4, 8) == ["no-spaces-here-at-all-" * 4]
    assert cut_text("short", 8) == ["short"]


@SETTINGS
@given(text=content, special=st.booleans())
def test_text_cut_in_small_chunks_encodes_as_the_engine(
    chat: ChatTokenizer, shared: CachedEncoder, text: str, special: bool
) -> None:
    """Pieces cut every few characters (instead of every 2048): every place a cut may fall."""
    encoder = shared
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("shared.token_cache.CUT_CHARS", 2)
        long_text = " ".join([text, "words between them", text, "and more words", text])
        for _ in range(2):  # cold, then from the cache
            assert encoder.encode(long_text, special) == chat.encode(long_text, special)
            split = encoder.encode_text_known(long_text, special)
            assert split is not None
            assert list(encoder.complete(split.ids, split.rest)) == chat.encode(long_text, special)


def test_a_shared_long_prefix_is_encoded_once(chat: ChatTokenizer) -> None:
    encoder = CachedEncoder(chat)
    assert encoder.stats()["cuts"] == "every 2048 characters"
    rng = random.Random(7)
    words = ("river", "stone", "ledger", "parcel", "harbour", "quiet", "lantern", "copper")
    document = " ".join(rng.choice(words) for _ in range(6000))  # ~40K characters, one piece
    assert len(document) > 10 * CUT_CHARS
    encoder.encode(document + "\n\nQuestion: what is it?")
    before = encoder.stats()["encoded_tokens"]
    ids = encoder.encode(document + "\n\nQuestion: who wrote it?")
    assert ids == chat.encode(document + "\n\nQuestion: who wrote it?")
    new = encoder.stats()["encoded_tokens"] - before
    assert 0 < new < 0.15 * len(ids)  # the last chunk or two, not the document again
    # at most the document's last chunk (a cut does not depend on where the text ends)
    tail = chat.encode(document[-(CUT_CHARS + 100) :] + "\n\nQuestion: who wrote it?", False)
    assert new <= len(tail)


def test_a_long_piece_is_indexed_by_its_first_and_last_chunks(chat: ChatTokenizer) -> None:
    """Only they are encoded with offsets (a quarter of an encode's time): a text that
    continues the document parts from it in its last chunk, one that shares only its start
    in its first; either is guessed, and a middle chunk is known exactly when it matters."""
    rng = random.Random(7)
    words = ("river", "stone", "ledger", "parcel", "harbour", "quiet", "lantern", "copper")
    document = " ".join(rng.choice(words) for _ in range(6000))  # ~40K characters, one piece
    assert len(document) > 10 * CUT_CHARS
    for thread in (False, True):
        encoder = CachedEncoder(chat)
        known = encoder.encode_text_known(document + "\n\nQuestion: what is it?")
        assert known is not None and len(known.rest[0::2]) > 3
        if thread:
            ids = asyncio.run(encoder.complete_async(known.ids, known.rest))
            encoder.close()
        else:
            ids = encoder.complete(known.ids, known.rest)
        assert ids.tolist() == chat.encode(document + "\n\nQuestion: what is it?")
        assert len(encoder.prefixes) == 2
        for other in (document + "\n\nQuestion: who wrote it?", document[:1000] + " Other."):
            again = encoder.encode_text_known(other)
            assert again is not None and len(again.guess) > 0
            exact = array("I", chat.encode(other)[len(again.ids) :])
            assert encoder.check_guess(again.guess, exact)


def test_a_normalizer_turns_cuts_off_and_encodes_stay_exact(
    model_dir: Path, tmp_path: Path
) -> None:
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((model_dir / "tokenizer.json").read_text())
    config["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    chat = ChatTokenizer(tmp_path)
    encoder = CachedEncoder(chat)
    assert encoder.stats()["cuts"] == "off: a normalizer runs over the whole text"
    text = "Some Words " * 1000
    assert encoder.encode(text) == chat.encode(text)
    assert encoder.stats()["cached_pieces"] <= 1


def test_new_text_is_estimated_at_the_rate_text_has_encoded_at(chat: ChatTokenizer) -> None:
    """A cold prompt's length before its encode: at 4 characters a token until the encoder
    has seen text, then at the rate it has encoded at (long words: fewer tokens a char)."""
    encoder = CachedEncoder(chat)
    words = "extraordinary considerations notwithstanding " * 200
    assert encoder.estimate_tokens([words]) == len(words) // 4
    encoder.encode(words)
    fresh = "notwithstanding extraordinary considerations " * 150
    actual = len(chat.encode(fresh, False))
    assert abs(encoder.estimate_tokens([fresh]) - actual) < 0.15 * actual
    assert (
        encoder.estimate_tokens(["", "<|im_end|>", fresh]) == encoder.estimate_tokens([fresh]) + 1
    )

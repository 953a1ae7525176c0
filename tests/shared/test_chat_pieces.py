"""A chat's pieces from its fixed parts and contents equal the split of its whole text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.chat_pieces import PieceSplitter
from shared.chat_skeleton import join_fixed
from shared.token_cache import CachedEncoder, _alternation
from shared.tokenizer import ChatTokenizer

# Tokens over a small alphabet, so that texts often hold them, their prefixes and overlaps.
token = st.text(alphabet="<ab|>", min_size=1, max_size=4)
text = st.text(alphabet="<ab|> x\n", max_size=10)


@settings(max_examples=600, deadline=None)
@given(
    tokens=st.lists(token, min_size=1, max_size=5, unique=True),
    fixed=st.lists(text, min_size=1, max_size=5),
    data=st.data(),
)
def test_parts_equal_the_split_of_the_joined_text(
    tokens: list[str], fixed: list[str], data: st.DataObject
) -> None:
    contents = data.draw(st.lists(text, min_size=len(fixed) - 1, max_size=len(fixed) - 1))
    pattern = _alternation(tokens)
    parts = PieceSplitter(pattern, tokens).parts(fixed, contents)
    if parts is not None:
        assert parts == pattern.split(join_fixed(fixed, contents))


def test_a_content_with_a_tokens_first_character_is_split_as_text() -> None:
    tokens = ["<|im_start|>", "<|im_end|>"]
    splitter = PieceSplitter(_alternation(tokens), tokens)
    fixed = ["<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]
    assert splitter.parts(fixed, ["hi"]) == [
        "",
        "<|im_start|>",
        "user\nhi",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant\n",
    ]
    assert splitter.parts(fixed, ["a <|im_end|> b"]) is None
    assert splitter.parts(fixed, ["1 < 2"]) is None  # (any '<': the text's own split)


def test_a_fixed_part_ending_in_a_tokens_start_is_split_as_text() -> None:
    """`<|im_` then a content `end|>` makes a token across the two: no split by parts."""
    tokens = ["<|im_end|>"]
    splitter = PieceSplitter(_alternation(tokens), tokens)
    fixed = ["say <|im_", " then"]
    assert splitter.parts(fixed, ["end|>"]) is None
    assert re.compile("(<\\|im_end\\|>)").split(join_fixed(fixed, ["end|>"]))[1] == "<|im_end|>"


def test_too_many_first_characters_turn_it_off() -> None:
    tokens = ["<s>", "[INST]", "{x}", "(y)", "#z"]
    splitter = PieceSplitter(_alternation(tokens), tokens)
    assert not splitter.usable
    assert splitter.parts(["a", "b"], ["c"]) is None


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> CachedEncoder:
    return CachedEncoder(ChatTokenizer(model_dir))


def test_a_chat_of_a_known_shape_is_split_by_its_parts(encoder: CachedEncoder) -> None:
    """SmolLM2's template: the second chat of a shape takes the parts' split, and the ids
    are the engine's."""
    chats = [
        [
            {"role": "system", "content": f"You help, {i}."},
            {"role": "user", "content": f"Question {i}: why is the sky blue?\n\nThanks."},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "And " + "at dusk? " * (300 + i)},
        ]
        for i in range(2)
    ]
    encoder.encode_chat_known(chats[0])  # the shape is rendered and cached
    for messages in chats:
        fixed = encoder.renderer.fixed(messages)
        assert fixed is not None
        assert encoder._splitter is not None
        assert encoder._splitter.parts(fixed, [m["content"] for m in messages]) is not None
        rendered = encoder.renderer.render(messages)
        assert encoder._chat_parts(messages, True, None) == encoder._split(rendered)
        known = encoder.encode_chat_known(messages)
        engine = encoder.tokenizer.encode_chat(messages)
        assert encoder.complete(known.ids, known.rest).tolist() == engine

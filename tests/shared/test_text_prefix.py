"""PrefixIndex: a new piece's likely first ids from an earlier piece's encode, for three
tokenizer families, against the exact encode."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from shared.text_prefix import FIRST_CHARS, MIN_CHARS, PrefixIndex, token_ends
from shared.token_cache import CachedEncoder
from shared.tokenizer import ChatTokenizer
from tests.tokenizer_families import FAMILIES, shared_start, tokenizer_dir


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Tokenizer:
    root = tmp_path_factory.mktemp("families")
    return Tokenizer.from_file(
        str(tokenizer_dir(request.param, root, model_dir) / "tokenizer.json")
    )


def _indexed(index: PrefixIndex, tok: Tokenizer, text: str) -> list[int]:
    encoding = tok.encode(text, add_special_tokens=False)
    index.add(text, array("I", encoding.ids), token_ends(encoding.offsets))
    return list(encoding.ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shared=st.text(min_size=1, max_size=600),
    first=st.text(min_size=1, max_size=60),
    second=st.text(min_size=1, max_size=60),
)
def test_a_guess_is_the_start_of_the_exact_encode(
    tokenizer: Tokenizer, shared: str, first: str, second: str
) -> None:
    """The guess is what the new text encodes to, but for its last few tokens (at most the
    margin's: 4 characters of up to 4 tokens each and 1 more), and never longer than what
    the two texts share."""
    index = PrefixIndex()
    a, b = shared + first, shared + second
    ids_a = _indexed(index, tokenizer, a)
    ids_b = tokenizer.encode(b, add_special_tokens=False).ids
    guess = index.guess(b).tolist()
    common = shared_start(ids_a, ids_b)
    assert guess == ids_a[: len(guess)]
    assert len(guess) <= common + 1  # a token at the parting point may differ (measured: rare)
    if len(a) >= MIN_CHARS and len(b) >= MIN_CHARS and shared_start(a, b) >= 2 * FIRST_CHARS:
        assert len(guess) >= common - (4 * 4 + 1) - 4 * FIRST_CHARS, (len(guess), common)


def test_the_longest_shared_start_wins_and_short_texts_are_not_guessed() -> None:
    index = PrefixIndex()
    ids = array("I", range(100))
    ends = array("I", range(1, 101))  # one token a character
    index.add("a" * 100, ids, ends)
    index.add("a" * 50 + "b" * 50, array("I", range(1000, 1100)), ends)
    assert index.guess("a" * 90 + "c" * 10).tolist() == list(range(85))  # 90 - 4 chars - 1
    assert index.guess("a" * 50 + "b" * 40 + "c").tolist() == list(range(1000, 1085))
    assert index.guess("a" * (FIRST_CHARS - 1)).tolist() == []
    assert index.guess("z" * 100).tolist() == []
    index.add("short", array("I", [1]), array("I", [5]))
    assert len(index) == 2  # under MIN_CHARS: not indexed


def test_the_index_keeps_its_token_budget_and_forgets_what_it_is_told_to() -> None:
    index = PrefixIndex(max_tokens=250)
    for k in range(5):
        text = f"{k}" * 100
        index.add(text, array("I", range(100)), array("I", range(1, 101)))
    assert len(index) == 2  # 3 x 100 tokens would pass 250: the oldest went
    assert index.guess("0" * 100 + "x").tolist() == []
    assert len(index.guess("4" * 100 + "x")) > 0
    index.discard("4" * 100)
    assert index.guess("4" * 100 + "x").tolist() == []
    assert index.ends("3" * 100) is not None
    index.clear()
    assert len(index) == 0 and index.guess("3" * 100 + "x").tolist() == []


def test_mismatched_ids_and_ends_are_not_indexed() -> None:
    index = PrefixIndex()
    index.add("x" * 100, array("I", range(10)), array("I", range(5)))
    assert len(index) == 0


def test_token_ends_never_go_back() -> None:
    # the bytes of one character are tokens with the same offsets; trimmed offsets shrink
    assert token_ends([(0, 1), (1, 2), (1, 2), (2, 3), (2, 2)]).tolist() == [1, 2, 2, 3, 3]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_encoded_piecewise(family: str, tmp_path: Path, model_dir: Path) -> None:
    """DeepSeek's empty normalizer Sequence normalizes nothing: its text is encoded piece by
    piece and cut into chunks, as the tiny model's is (it fell back to full encodes)."""
    encoder = CachedEncoder(ChatTokenizer(tokenizer_dir(family, tmp_path, model_dir)))
    assert encoder.mode == "piecewise"
    text = "文档" * 3000 + " question one?"
    known = encoder.encode_text_known(text)
    assert known is not None
    full = encoder.complete(known.ids, known.rest)
    assert full.tolist() == encoder.tokenizer.encode(text)
    again = encoder.encode_text_known("文档" * 3000 + " question two?")
    assert again is not None
    guessed = again.ids.tolist() + again.guess.tolist()
    assert len(guessed) > len(full) - 40 and guessed == full.tolist()[: len(guessed)]
    assert encoder.check_guess(again.guess, full[len(again.ids) :])
    assert not encoder.check_guess(array("I", [7, 7, 7]), array("I", [7, 8, 7]))
    assert encoder.stats()["guess_mismatches"] == 1


class _Encoded:
    """An encode whose offsets are read at most once (and counted)."""

    def __init__(self, offsets: list[tuple[int, int]]) -> None:
        self._offsets = offsets
        self.reads = 0

    @property
    def offsets(self) -> list[tuple[int, int]]:
        self.reads += 1
        return self._offsets


def test_ends_are_read_from_the_encode_when_a_guess_needs_them_or_on_settle() -> None:
    index = PrefixIndex()
    one = [(i, i + 1) for i in range(100)]
    used, unused = _Encoded(one), _Encoded(one)
    index.add("a" * 100, array("I", range(100)), used)
    index.add("b" * 100, array("I", range(100)), unused)
    assert index.unsettled == 2 and used.reads == 0
    assert index.guess("a" * 90 + "c").tolist() == list(range(85))
    assert used.reads == 1 and unused.reads == 0  # only the piece the guess came from
    index.settle()
    assert index.unsettled == 0 and unused.reads == 1 and used.reads == 1
    assert len(index.guess("b" * 90 + "c")) == 85
    wrong = _Encoded(one[:10])  # offsets that do not match the ids: the piece is dropped
    index.add("c" * 100, array("I", range(100)), wrong)
    assert index.guess("c" * 90 + "x").tolist() == [] and index.ends("c" * 100) is None


def test_an_engine_encoder_keeps_no_index(model_dir: Path) -> None:
    encoder = CachedEncoder(ChatTokenizer(model_dir), guesses=False)
    text = "word " * 2000
    assert encoder.encode(text + "one") == encoder.tokenizer.encode(text + "one")
    known = encoder.encode_text_known(text + "two")
    assert known is not None and len(known.guess) == 0 and len(encoder.prefixes) == 0

"""Rendering by substitution equals the chat template, and refuses templates it cannot copy."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.chat_skeleton import SkeletonRenderer
from shared.tokenizer import ChatTokenizer

FRAGMENT = st.sampled_from(list("ab \n\t<>|_'\"\\{}%#é中🙂") + ["<|im_start|>", "<|im_end|>"])
TEXT = st.lists(FRAGMENT, max_size=30).map("".join)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}
)


def with_template(model_dir: Path, template: str) -> ChatTokenizer:
    tok = ChatTokenizer(model_dir)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def smol(model_dir: Path) -> SkeletonRenderer:
    return SkeletonRenderer(ChatTokenizer(model_dir))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(MESSAGE, min_size=1, max_size=6), gen=st.booleans())
def test_substitution_equals_the_template(
    smol: SkeletonRenderer, messages: list[dict], gen: bool
) -> None:
    assert smol.reason is None  # SmolLM2's template copies contents verbatim
    want = smol.tokenizer.render_chat(messages, add_generation_prompt=gen)
    assert smol.render(messages, gen) == want
    assert smol.render(messages, gen) == want  # again, from the cached shape


def test_shapes_are_rendered_once_and_bounded(model_dir: Path) -> None:
    renderer = SkeletonRenderer(ChatTokenizer(model_dir), max_shapes=2)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for turn in range(3):
        renderer.render([*chat[:1], {"role": "user", "content": f"question {turn}"}])
    assert renderer.builds == 1 and renderer.hits == 2
    for n in range(1, 5):  # four more shapes through a cache of two
        renderer.render([{"role": "user", "content": "x"}] * n)
    assert renderer.num_shapes == 2
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert renderer.render(chat, tools=tools) == renderer.tokenizer.render_chat(chat, tools=tools)


@pytest.mark.parametrize(
    ("template", "refused_by"),
    [
        ("{% for m in messages %}{{ m['content'] | trim }}{% endfor %}", "Filter"),
        ("{% for m in messages %}{% if 'x' in m.content %}X{% endif %}{% endfor %}", "Operand"),
        ("{% for m in messages %}{{ m.content.strip() }}{% endfor %}", "Getattr"),
        ("{% for m in messages %}{% set c = m['content'] %}{{ c }}{% endfor %}", "Assign"),
        ("{% for m in messages %}{{ m['content'] if m['role'] else '' }}{% endfor %}", "CondExpr"),
    ],
)
def test_templates_that_touch_content_are_rendered_in_full(
    model_dir: Path, template: str, refused_by: str
) -> None:
    renderer = SkeletonRenderer(with_template(model_dir, template))
    assert renderer.reason is not None and refused_by in renderer.reason
    messages = [{"role": "user", "content": "  x y  "}]
    assert renderer.render(messages) == renderer.tokenizer.render_chat(messages)
    assert renderer.hits == 0


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages | tojson }}",  # escaped, never verbatim
        "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}",  # twice
        "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}",  # out of order
    ],
)
def test_shapes_whose_sentinels_are_not_copied_verbatim_once_are_not_cached(
    model_dir: Path, template: str
) -> None:
    renderer = SkeletonRenderer(with_template(model_dir, template))
    messages = [{"role": "user", "content": 'a "quoted"\n line'}, {"role": "user", "content": "b"}]
    for _ in range(2):
        assert renderer.render(messages) == renderer.tokenizer.render_chat(messages)
    assert renderer.hits == 0

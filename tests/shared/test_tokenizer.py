"""The chat template renders exactly as transformers does and stays sandboxed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.tokenizer import ChatTemplateError, ChatTokenizer


def with_template(model_dir: Path, template: str) -> ChatTokenizer:
    tok = ChatTokenizer(model_dir)
    tok.chat_template = template  # read once, when the template is first compiled
    return tok


@pytest.mark.parametrize(
    ("template", "unsafe"),
    [
        ("{{ messages.append(1) }}", "'append' of 'list'"),  # mutates a list
        ("{{ messages[0].clear() }}", "'clear' of 'dict'"),  # mutates a dict
        ("{{ ''.__class__.__mro__ }}", "'__class__' of 'str'"),  # walks to object
    ],
)
def test_unsafe_templates_are_refused_every_time(
    model_dir: Path, template: str, unsafe: str
) -> None:
    tok = with_template(model_dir, template)
    for _ in range(2):  # the second time answers from the remembered verdict
        with pytest.raises(ChatTemplateError, match=f"access to attribute {unsafe}"):
            tok.render_chat([{"role": "user", "content": "hi"}])


def test_function_internals_render_as_nothing(model_dir: Path) -> None:
    tok = with_template(
        model_dir, "[{{ raise_exception.__globals__ }}{{ raise_exception.__code__ }}]"
    )
    assert [tok.render_chat([{"role": "user", "content": "hi"}]) for _ in range(2)] == ["[]"] * 2


def test_safe_attributes_render_the_same_on_every_call(model_dir: Path) -> None:
    tok = ChatTokenizer(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Scattering."},
        {"role": "user", "content": "And sunsets?"},
    ]
    first = tok.render_chat(messages)
    assert first.endswith("<|im_start|>assistant\n") and "Scattering." in first
    assert all(tok.render_chat(messages) == first for _ in range(3))

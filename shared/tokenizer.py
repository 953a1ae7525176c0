"""Tokenizer and chat template, exactly as the engine applies them, without transformers.

The worker and the router both load this from the model directory (tokenizer.json plus the
chat template in tokenizer_config.json or chat_template.jinja), so router tokens equal
engine tokens. The template is rendered the way transformers renders it: a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class _TemplateSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with its attribute verdicts remembered per (type, name).

    The sandbox asks, on every attribute a template reads (`loop.first`, `message.role`),
    whether it is safe; the answer depends only on the object's type and the name (jinja2's
    is_internal_attribute and modifies_known_mutable test types, not values), so remembering
    it is exact and saves most of a long chat's render time.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = self._verdicts[key] = super().is_safe_attribute(obj, attr, value)
        return verdict


class PromptEncoder(Protocol):
    """What turns a request's prompt into ids: `ChatTokenizer`, or its exact cache."""

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class ChatTokenizer:
    """Encode, decode and render chat messages the way the model's engine does."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self.path = model_dir
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template = config.get("chat_template")
        jinja_file = model_dir / "chat_template.jinja"
        if not template and jinja_file.exists():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` itself: what the engine encodes with."""
        return self._tok

    @cached_property
    def compiled_template(self) -> jinja2.Template:
        """The chat template, compiled once; ChatTemplateError if the model has none."""
        if not self.chat_template:
            raise ChatTemplateError(f"the model at {self.path} has no chat template")
        env = _TemplateSandbox(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda v, indent=None: json.dumps(
            v, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of these messages."""
        try:
            return self.compiled_template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Token ids of the rendered chat (the template carries its own special tokens)."""
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


class IncrementalDecoder:
    """Text deltas for streaming: holds back an incomplete UTF-8 character at the end."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
        self._sent = 0
        self.text = ""

    def update(self, ids: Sequence[int]) -> str:
        """Decode the whole output so far and return what has not been sent yet."""
        text = self._tokenizer.decode(ids)
        stable = text[:-1] if text.endswith("\ufffd") else text
        delta = stable[self._sent :]
        self._sent = len(stable)
        self.text = text
        return delta

    def finish(self, final_text: str) -> str:
        """The last delta, given the final (stop-trimmed) text."""
        delta = final_text[self._sent :]
        self._sent = max(self._sent, len(final_text))
        self.text = final_text
        return delta

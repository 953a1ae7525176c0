"""The request bodies of the three APIs the benchmarks speak, built in one place."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import msgspec

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"  # SGLang's native API: text in, text and meta_info out

_encode = msgspec.json.Encoder().encode


def body(
    path: str,
    prompt: list[dict[str, str]] | str,
    max_tokens: int,
    *,
    stream: bool = False,
    model: str | None = None,
    ignore_eos: bool = False,
    usage: bool = False,
    user: str | None = None,
    lora_path: str | None = None,
) -> bytes:
    """A greedy (`temperature` 0) request to `path`: `prompt` is the chat's messages for
    CHAT, the text for COMPLETIONS and GENERATE. `ignore_eos` makes every answer
    `max_tokens` long; `usage` asks an OpenAI stream for its usage chunk; `user` names the
    session (our `session` policy sticks by it); `model` names the served model (smg
    refuses requests that name none); `lora_path` names a LoRA adapter, as SGLang takes it on
    every route."""
    adapter = {} if lora_path is None else {"lora_path": lora_path}
    if path == GENERATE:
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0}
        if ignore_eos:
            sampling["ignore_eos"] = True
        return _encode({"text": prompt, "sampling_params": sampling, "stream": stream, **adapter})
    out: dict[str, Any] = {} if model is None else {"model": model}
    out.update(adapter)
    out["messages" if path == CHAT else "prompt"] = prompt
    out.update(max_tokens=max_tokens, temperature=0)
    if ignore_eos:
        out["ignore_eos"] = True
    if stream:
        out["stream"] = True
        if usage:
            out["stream_options"] = {"include_usage": True}
    if user is not None:
        out["user"] = user
    return _encode(out)


def served_model(url: str) -> str:
    """The model a server serves (its /v1/models), as bodies name it (peers require it)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])

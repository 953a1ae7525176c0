"""Request bodies of SGLang's native and OpenAI-compatible APIs, validated into one form.

Anything malformed raises BadRequest with a message naming the field; the server turns it
into HTTP 400 with a JSON body, and the worker keeps serving.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from connector.worker.sequence import SamplingParams
from shared import namespaces
from shared.namespaces import NamespaceFields, namespace_fields
from shared.tokenizer import ChatTemplateError, PromptEncoder

# SGLang sampling parameters this worker accepts but does not apply (kept for compatibility).
_IGNORED_SAMPLING = {
    "min_new_tokens",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "no_stop_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "custom_params",
    "logit_bias",
    "stream_interval",
}
_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "sampling_seed",
    "seed",
}
# Top-level /generate fields accepted and passed over (routing, PD, cache namespaces, ...).
_PASSTHROUGH = {
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "extra_key",
    "cache_salt",
    "priority",
    "routing_key",
    "lora_path",
    "shared_prefix_tokens",
    "data_parallel_rank",
    "log_metrics",
    "return_text_in_logprobs",
    "logprob_start_len",
    "top_logprobs_num",
    "return_hidden_states",
    "session_params",
    "custom_logit_processor",
    "modalities",
    "memserve",
}


class BadRequest(ValueError):
    """The request is malformed; the message says which field and why."""


@dataclass(slots=True)
class GenerateInput:
    """A validated request: token ids, sampling, streaming and how to answer."""

    input_ids: list[int]
    sampling: SamplingParams
    stream: bool
    rid: str
    extras: dict[str, Any] = field(default_factory=dict)


def _type_error(name: str, expected: str, value: Any) -> BadRequest:
    return BadRequest(f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.60}")


def _int(name: str, value: Any, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if low is not None and value < low:
        raise BadRequest(f"'{name}' must be >= {low}, got {value}")
    return value


def _float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must lie in [{low}, {high}], got {value}")
    return float(value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "true or false", value)
    return value


def memserve_options(extras: dict[str, Any]) -> dict[str, Any]:
    """The router's `"memserve": {...}` field of a request ({} without one); BadRequest
    when it is not an object."""
    options = extras.get("memserve")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise _type_error("memserve", "an object", options)
    return options


def cache_fields(extras: dict[str, Any]) -> NamespaceFields:
    """The cache namespace fields of a request, checked (BadRequest says which is wrong)."""
    try:
        return namespace_fields(extras)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def write_back_wanted(extras: dict[str, Any]) -> bool:
    """`memserve.write_back` (default true): whether a PD-Caching-3 decode writes this
    request's KV back to its prefill; the router's write-back gate says false when the
    prefill has not been reusing what decodes wrote back."""
    value = memserve_options(extras).get("write_back", True)
    return _bool("memserve.write_back", value)


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise _type_error("stop", "a string or a list of strings", value)


def _encode(encode: Callable[[str], list[int]], text: str) -> list[int]:
    """Text -> ids; text no tokenizer takes (a lone surrogate from a JSON escape) is the
    client's error, a 400, not the worker's 500."""
    try:
        return encode(text)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"cannot tokenize the prompt: {exc}") from None


def _token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise _type_error(name, "a list of non-negative integer token ids", value)
    return value


def check_vocab(name: str, ids: list[int], vocab_size: int) -> None:
    """SGLang refuses ids the model has no embedding for (its tokenizer manager's check)."""
    top = max(ids, default=0)
    if top >= vocab_size:
        raise BadRequest(f"'{name}': token id {top} is outside the vocabulary (size {vocab_size})")


def parse_sampling(raw: Any, default_max_new_tokens: int = 128) -> SamplingParams:
    """SGLang `sampling_params`: known names type-checked, unknown names refused."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _type_error("sampling_params", "an object", raw)
    unknown = set(raw) - _SAMPLING - _IGNORED_SAMPLING - {"json_schema", "regex", "ebnf"}
    if unknown:
        raise BadRequest(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    for constrained in ("json_schema", "regex", "ebnf"):
        if raw.get(constrained) is not None:
            raise BadRequest(f"'{constrained}' (constrained decoding) is not supported")
    params = SamplingParams(max_new_tokens=default_max_new_tokens)
    if raw.get("max_new_tokens") is not None:
        params.max_new_tokens = _int("max_new_tokens", raw["max_new_tokens"], low=0)
    if raw.get("temperature") is not None:
        params.temperature = _float("temperature", raw["temperature"], 0.0, 100.0)
    if raw.get("top_p") is not None:
        params.top_p = _float("top_p", raw["top_p"], 1e-9, 1.0)
    if raw.get("top_k") is not None:
        params.top_k = _int("top_k", raw["top_k"], low=-1)
        if params.top_k == 0:
            raise BadRequest("'top_k' must be -1 (disabled) or >= 1, got 0")
    params.stop = _stop(raw.get("stop"))
    if raw.get("stop_token_ids") is not None:
        params.stop_token_ids = _token_ids("stop_token_ids", raw["stop_token_ids"])
    if raw.get("ignore_eos") is not None:
        params.ignore_eos = _bool("ignore_eos", raw["ignore_eos"])
    if raw.get("n") is not None and _int("n", raw["n"], low=1) != 1:
        raise BadRequest("'n' > 1 is not supported; send n requests")
    seed = raw.get("sampling_seed", raw.get("seed"))
    if seed is not None:
        params.seed = _int("sampling_seed", seed, low=0)
    return params


def _rid(raw: Any) -> str:
    if raw is None:
        return uuid.uuid4().hex
    if not isinstance(raw, str) or not raw:
        raise _type_error("rid", "a non-empty string", raw)
    return raw


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_generate(body: Any, tokenizer: PromptEncoder) -> GenerateInput:
    """SGLang `/generate`: one prompt as `text` or `input_ids`."""
    body = _body(body)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise BadRequest("batch requests (a list of prompts) are not supported; send one each")
    if body.get("return_logprob"):
        raise BadRequest("'return_logprob' is not supported by this worker yet")
    if text is not None:
        if not isinstance(text, str):
            raise _type_error("text", "a string", text)
        input_ids = _encode(tokenizer.encode, text)
    else:
        input_ids = _token_ids("input_ids", ids)
    if not input_ids:
        raise BadRequest("the prompt is empty")
    stream = _bool("stream", body.get("stream", False))
    extras = {k: body[k] for k in _PASSTHROUGH if k in body}
    return GenerateInput(
        input_ids,
        parse_sampling(body.get("sampling_params")),
        stream,
        _rid(body.get("rid")),
        extras,
    )


def _openai_input(
    body: dict[str, Any], input_ids: list[int], max_keys: tuple[str, ...], default_max: int
) -> tuple[GenerateInput, bool]:
    """The part OpenAI chat and completions share: sampling, streaming, rid, extras."""
    raw = {
        k: body[k]
        for k in _SAMPLING - {"max_new_tokens", "sampling_seed"}
        if body.get(k) is not None
    }
    raw["max_new_tokens"] = next(
        (body[k] for k in max_keys if body.get(k) is not None), default_max
    )
    sampling = parse_sampling(raw)
    stream = _bool("stream", body.get("stream", False))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    extras = {k: body[k] for k in _PASSTHROUGH if k in body}
    adapter = model_adapter(body.get("model"))
    if adapter is not None:  # SGLang: "base:adapter" wins over lora_path
        extras["lora_path"] = adapter
    gen = GenerateInput(input_ids, sampling, stream, _rid(body.get("rid")), extras)
    return gen, bool(options.get("include_usage", False))


def model_adapter(model: Any) -> str | None:
    """The adapter of an OpenAI `model` in SGLang's `base:adapter` form (None: none)."""
    try:
        return namespaces.model_adapter(model)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _message_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"messages[{index}].content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"messages[{index}].content: a text part needs a 'text' string")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise _type_error(f"messages[{index}].content", "a string or a list of parts", content)


def parse_chat(body: Any, tokenizer: PromptEncoder) -> tuple[GenerateInput, bool]:
    """OpenAI `/v1/chat/completions`; returns the input and whether to report usage in streams."""
    body = _body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role' string")
        clean.append({**msg, "content": _message_text(i, msg.get("content"))})
    try:
        input_ids = _encode(lambda _: tokenizer.encode_chat(clean, tools=body.get("tools")), "")
    except ChatTemplateError as exc:
        raise BadRequest(str(exc)) from None
    return _openai_input(body, input_ids, ("max_completion_tokens", "max_tokens"), 128)


def parse_completion(body: Any, tokenizer: PromptEncoder) -> tuple[GenerateInput, bool]:
    """OpenAI `/v1/completions` with one prompt (text or token ids)."""
    body = _body(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        input_ids = _encode(tokenizer.encode, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        input_ids = _token_ids("prompt", prompt)
    elif isinstance(prompt, list):
        raise BadRequest("'prompt' as a list of prompts is not supported; send one each")
    else:
        raise _type_error("prompt", "a string or a list of token ids", prompt)
    if not input_ids:
        raise BadRequest("the prompt is empty")
    if body.get("echo") or body.get("logprobs") is not None:
        raise BadRequest("'echo' and 'logprobs' are not supported by this worker yet")
    return _openai_input(body, input_ids, ("max_tokens",), 16)  # OpenAI's default: 16

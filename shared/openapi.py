"""SGLang's inference API as an OpenAPI 3.0 document: what our worker and router accept.

Both serve it at `/openapi.json` (the router adds its management routes), so clients and
fuzzers (schemathesis) know the shapes. Request schemas name the fields SGLang and OpenAI
define and let any other field through, as the servers do; the error body is the one
`shared.http_errors.json_error` writes.
"""

from __future__ import annotations

from typing import Any

JSON = "application/json"
Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}}
STOP: Schema = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

# What OpenAI's chat and text completions both take besides their prompt and length.
OPENAI_SAMPLING: Schema = {
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
    "stop": STOP,
    "stream": {"type": "boolean"},
    "user": {"type": "string"},
    "seed": {"type": "integer"},
}

SCHEMAS: dict[str, Schema] = {
    "Error": {
        "type": "object",
        "required": ["object", "message", "type", "code"],
        "properties": {
            "object": {"type": "string", "enum": ["error"]},
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"nullable": True},
            "code": {"type": "integer"},
        },
    },
    "SamplingParams": {
        "type": "object",
        "properties": {
            "max_new_tokens": {"type": "integer", "minimum": 0},
            "temperature": {"type": "number", "minimum": 0},
            "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer"},
            "stop": STOP,
            "stop_token_ids": TOKEN_IDS,
            "ignore_eos": {"type": "boolean"},
            "seed": {"type": "integer"},
        },
    },
    "GenerateRequest": {
        "type": "object",
        "description": "SGLang's native /generate: exactly one of text and input_ids.",
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}],
        "properties": {
            "text": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
            "input_ids": {"oneOf": [TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]},
            "sampling_params": _ref("SamplingParams"),
            "stream": {"type": "boolean"},
            "return_logprob": {"type": "boolean"},
            "rid": {"type": "string"},
            "bootstrap_host": {"type": "string"},
            "bootstrap_port": {"type": "integer", "nullable": True},
            "bootstrap_room": {"type": "integer", "minimum": 0},
        },
    },
    "Message": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string"},
            "content": {
                "nullable": True,
                "oneOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
                        },
                    },
                ],
            },
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
            "max_tokens": {"type": "integer", "minimum": 0},
            "max_completion_tokens": {"type": "integer", "minimum": 0},
            **OPENAI_SAMPLING,
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, TOKEN_IDS]},
            "max_tokens": {"type": "integer", "minimum": 0},
            **OPENAI_SAMPLING,
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string"}},
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        "properties": {"tokens": TOKEN_IDS},
    },
    "Answer": {
        "type": "object",
        "description": "SGLang's /generate answer, or an OpenAI completion object.",
    },
}

ERRORS: dict[str, Schema] = {
    str(status): {
        "description": why,
        "content": {JSON: {"schema": _ref("Error")}},
    }
    for status, why in (
        (400, "the request is malformed"),
        (401, "missing or wrong API key"),
        (404, "unknown model or route"),
        (413, "the body is larger than the server accepts"),
        (429, "over the concurrency, queue or rate limit; see Retry-After"),
        (502, "the engine failed the request"),
        (503, "no engine can serve it now"),
    )
}


def post(summary: str, request: str, answer: str = "Answer") -> Schema:
    """A POST operation taking a JSON `request` schema."""
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": "the answer (a JSON object, or text/event-stream when streaming)",
                "content": {JSON: {"schema": _ref(answer)}},
            },
            **ERRORS,
        },
    }


def get(summary: str, content: str = JSON) -> Schema:
    """A GET operation answering `content`."""
    return {
        "summary": summary,
        "responses": {
            "200": {"description": summary, "content": {content: {"schema": {}}}},
            **{k: v for k, v in ERRORS.items() if k in ("401", "503")},
        },
    }


INFERENCE_PATHS: dict[str, Schema] = {
    "/generate": {"post": post("Generate (SGLang native)", "GenerateRequest")},
    "/v1/chat/completions": {"post": post("OpenAI chat completion", "ChatCompletionRequest")},
    "/v1/completions": {"post": post("OpenAI text completion", "CompletionRequest")},
    "/v1/models": {"get": get("The served model")},
    "/health": {"get": get("Liveness", "text/plain")},
    "/get_model_info": {"get": get("Model path, tokenizer path")},
    "/get_server_info": {"get": get("Server arguments and state")},
    "/metrics": {"get": get("Prometheus metrics", "text/plain")},
}


def worker_document(version: str) -> Schema:
    """Every route the worker serves (SGLang's names)."""
    paths: dict[str, Schema] = {
        **INFERENCE_PATHS,
        "/health_generate": {"get": get("Generate one token end to end", "text/plain")},
        "/flush_cache": {
            "get": get("Flush the prefix cache (400 while requests run)", "text/plain"),
            "post": get("Flush the prefix cache (400 while requests run)", "text/plain"),
        },
        "/get_load": {"get": get("Running and waiting requests, tokens in use")},
        "/v1/loads": {"get": get("Running and waiting requests, tokens in use")},
        "/tokenize": {"post": post("Token ids of a text", "TokenizeRequest")},
        "/detokenize": {"post": post("Text of token ids", "DetokenizeRequest")},
        "/openapi.json": {"get": get("This document")},
    }
    return document("memserve-worker", version, paths)


def document(title: str, version: str, paths: dict[str, Schema]) -> Schema:
    """An OpenAPI 3.0.3 document with the shared components."""
    return {
        "openapi": "3.0.3",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": SCHEMAS},
    }

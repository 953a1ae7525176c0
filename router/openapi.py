"""The router's OpenAPI document: SGLang's inference routes plus sglang-router's management."""

from __future__ import annotations

from shared.openapi import ERRORS, INFERENCE_PATHS, JSON, Schema, document, get

_URL_PARAM: Schema = {
    "name": "url",
    "in": "path",
    "required": True,
    "description": "the worker's URL, percent-encoded",
    "schema": {"type": "string"},
}

_QUERY_ADD_WORKER: Schema = {
    "summary": "Add a worker (sglang-router's form: its URL and model in the query)",
    "parameters": [
        {"name": name, "in": "query", "required": name == "url", "schema": {"type": "string"}}
        for name in ("url", "model_id")
    ],
    "responses": {"200": {"description": "the worker as registered"}, **ERRORS},
}

_ADD_WORKER: Schema = {
    "summary": "Add a worker",
    "requestBody": {
        "required": True,
        "content": {
            JSON: {
                "schema": {
                    "type": "object",
                    "required": ["url"],
                    "properties": {
                        "url": {"type": "string"},
                        "worker_type": {
                            "type": "string",
                            "enum": ["regular", "colocated", "prefill", "decode"],
                        },
                        "bootstrap_port": {"type": "integer", "nullable": True},
                        # the model it serves (--models: one of them); learned when absent
                        "model_id": {"type": "string", "nullable": True},
                    },
                }
            }
        },
    },
    "responses": {"200": {"description": "the worker as registered"}, **ERRORS},
}


def router_document(version: str) -> Schema:
    """Every route the router serves."""
    one_worker = {
        "parameters": [_URL_PARAM],
        "get": get("One worker"),
        "delete": {
            "summary": "Remove a worker",
            "responses": {"200": {"description": "removed"}, "404": ERRORS["404"]},
        },
    }
    paths: dict[str, Schema] = {
        **INFERENCE_PATHS,
        "/liveness": {"get": get("Liveness", "text/plain")},
        "/readiness": {"get": get("A healthy worker of every kind the router needs")},
        "/get_loads": {"get": get("Per-worker load")},
        "/flush_cache": {
            "get": get("Flush every worker's cache and the prompt trees"),
            "post": get("Flush every worker's cache and the prompt trees"),
        },
        "/workers": {"get": get("The workers"), "post": _ADD_WORKER},
        "/workers/{url}": one_worker,
        "/add_worker": {"post": _QUERY_ADD_WORKER},
        "/openapi.json": {"get": get("This document")},
    }
    return document("memserve-router", version, paths)

"""Several models behind one router (`--models FILE`): each with its own workers, tokenizer
and chat template, policy settings, and its own paths in the prompt trees.

The trees are shared: every model but the default one (the first) keys its paths in its own
cache namespace (`CacheNamespace.model`, as tenants and adapters are kept apart), so no
prefix matches across models, and KV events, replicas and sibling processes carry on as
they are. A request goes by its `model` field (SGLang's `base:adapter` too: the base names
the model); none, or "default", goes to the default model; an unknown one is a 404 naming
the served ones. Without `--models` the router serves whatever its workers serve, as
before.

The file is TOML (or JSON when it starts with `{`), one `[[model]]` table per model:

    [[model]]
    name = "llama"                      # what requests name in `model`
    tokenizer_path = "/models/llama"    # tokenizer.json (+ chat template), read offline
    policy = "prompt_tree"              # else --policy; thresholds else the flags'
    cache_threshold = 0.3
    worker_urls = ["http://10.0.0.1:30001"]
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from router.policies import Policy, Thresholds, policy_name
from router.request import RequestError
from router.workers import normalize_url
from shared.token_cache import CachedEncoder


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One `[[model]]` of the models file."""

    name: str
    tokenizer_path: str | None = None  # a model directory; None: --tokenizer-path or workers'
    policy: str | None = None  # None: --policy
    cache_threshold: float | None = None  # None: the router's flag
    balance_abs_threshold: int | None = None
    balance_rel_threshold: float | None = None
    worker_urls: list[str] = []

    def thresholds(self, default: Thresholds) -> Thresholds:
        """Its policy's thresholds, the router's flags where it gives none."""
        return Thresholds(
            default.cache if self.cache_threshold is None else self.cache_threshold,
            default.balance_abs
            if self.balance_abs_threshold is None
            else self.balance_abs_threshold,
            default.balance_rel
            if self.balance_rel_threshold is None
            else self.balance_rel_threshold,
        )


class _ModelsFile(msgspec.Struct, forbid_unknown_fields=True):
    model: list[ModelSpec]


def parse_models(text: str, name: str, check_paths: bool = True) -> list[ModelSpec]:
    """The models a file's text names, checked (their tokenizer directories too, unless not
    `check_paths`: an example read elsewhere); ValueError saying what is wrong and where."""
    try:
        data: Any = json.loads(text) if text.lstrip().startswith("{") else tomllib.loads(text)
        models = msgspec.convert(data, _ModelsFile).model
    except (ValueError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{name}: {exc} (expected [[model]] tables: name, ...)") from None
    if not models:
        raise ValueError(f"{name}: no [[model]] given")
    seen: dict[str, str] = {}  # worker URL -> its model
    names: set[str] = set()
    for i, m in enumerate(models):
        where = f"{name}: model[{i}]"
        if not m.name or ":" in m.name or m.name == "default" or not m.name.isprintable():
            raise ValueError(
                f"{where}: 'name' must be a non-empty printable name without ':' "
                f"(SGLang's base:adapter) and not 'default', got {m.name!r}"
            )
        if m.name in names:
            raise ValueError(f"{where}: model {m.name!r} is given twice")
        names.add(m.name)
        try:
            if m.policy is not None:
                policy_name(m.policy)  # ValueError naming the choices
            urls = [normalize_url(url) for url in m.worker_urls]
        except ValueError as exc:
            raise ValueError(f"{where} ({m.name}): {exc}") from None
        tokenizer = Path(m.tokenizer_path or ".") / "tokenizer.json"
        if check_paths and m.tokenizer_path is not None and not tokenizer.exists():
            raise ValueError(f"{where} ({m.name}): no tokenizer.json in {m.tokenizer_path}")
        for url in urls:
            if url in seen:
                raise ValueError(f"{where}: worker {url} is already under model {seen[url]!r}")
            seen[url] = m.name
    return models


def load_models(path: str) -> list[ModelSpec]:
    """`--models FILE`; SystemExit with what is wrong."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"--models: cannot read {path}: {exc}") from None
    try:
        return parse_models(text, path)
    except ValueError as exc:
        raise SystemExit(f"--models {exc}") from None


@dataclass(slots=True)
class ServedModel:
    """One model as the router serves it."""

    name: str
    policy: Policy  # colocated workers' (PD pairs use --prefill-policy / --decode-policy)
    encoder: CachedEncoder | None  # None unless some policy routes on tokens
    key: str = ""  # its namespace in the trees ("": the default model's, unkeyed)
    tokenizer_path: str | None = None


@dataclass(slots=True)
class Models:
    """The models a router serves, the first the default."""

    served: list[ServedModel]
    by_name: dict[str, ServedModel] = field(init=False)

    def __post_init__(self) -> None:
        self.by_name = {m.name: m for m in self.served}

    @property
    def default(self) -> ServedModel:
        return self.served[0]

    def resolve(self, model: object) -> ServedModel:
        """The model a request's `model` field names (its base in `base:adapter`); none or
        "default": the default; 404 naming the served ones for any other."""
        if model is None or model == "default":
            return self.served[0]
        if not isinstance(model, str):
            raise RequestError(400, "'model' must be a string")
        found = self.by_name.get(model) or self.by_name.get(model.split(":", 1)[0])
        if found is not None:
            return found
        if model.startswith("default:"):
            return self.served[0]
        raise RequestError(404, f"model {model!r} not found; served: {sorted(self.by_name)}")

    def key_of(self, model_id: str | None) -> str:
        """The tree namespace of a worker serving `model_id` (its KV events are keyed so)."""
        found = self.by_name.get(model_id or "")
        return found.key if found is not None else ""

    def info(self, workers_of: Callable[[str], list[str]]) -> list[dict[str, Any]]:
        """Per model: its policy, tokenizer and workers (/get_server_info)."""
        return [
            {
                "name": m.name,
                "default": i == 0,
                "policy": m.policy.name,
                "tokenizer_path": m.tokenizer_path,
                "workers": workers_of(m.name),
            }
            for i, m in enumerate(self.served)
        ]


def build_models(
    specs: list[ModelSpec],
    policy_of: Callable[[ModelSpec], Policy],
    encoder_of: Callable[[ModelSpec], CachedEncoder | None],
    needs_tokens: bool,
) -> Models:
    """The served models of a models file: each its policy and its encoder (every model's
    when `needs_tokens`, PD's policies routing on tokens); SystemExit for a model that routes
    on tokens without a tokenizer."""
    served = []
    for i, spec in enumerate(specs):
        policy = policy_of(spec)
        encoder = encoder_of(spec)
        if encoder is None and (needs_tokens or policy.uses_tokens):
            raise SystemExit(
                f"--models: model {spec.name!r} routes on tokens: give its tokenizer_path (a "
                "model directory with tokenizer.json) or workers whose /get_model_info names "
                "a local tokenizer_path"
            )
        key = "" if i == 0 else spec.name  # the default model's paths stay unkeyed
        served.append(ServedModel(spec.name, policy, encoder, key, spec.tokenizer_path))
    return Models(served)

"""A worker's LoRA adapters put back as they were at its start, so that every system a
benchmark compares on shared workers meets the same adapters loaded (a cache flush empties
the KV, not the adapter slots, and a run leaves the adapters its router placed).

SGLang's endpoints do it: `/unload_lora_adapter` every adapter that is loaded now or was at
the start, then `/load_lora_adapter` again, first the ones that should not stay (so they are
the least recently used) and then the start's in their order, whose loads evict the others
past `--max-loaded-loras`. A reload gets a new `lora_id` (a new cache namespace): nothing a
run computed is reachable by the next, as after a flush.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localrun.processes import JSON_HEADERS


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    pinned: bool


def registered(info: Mapping[str, Any]) -> list[Adapter]:
    """A worker's adapters, from its /get_server_info `lora` (registration order)."""
    lora = info.get("lora")
    entries = lora.get("adapters") if isinstance(lora, dict) else None
    return [
        Adapter(str(a["lora_name"]), str(a.get("lora_path") or ""), bool(a.get("pinned")))
        for a in entries or ()
        if isinstance(a, dict) and a.get("lora_name")
    ]


def resident(info: Mapping[str, Any]) -> list[str]:
    """The adapters loaded now, pinned first (the order a worker loads them at its start)."""
    lora = info.get("lora")
    entries = lora.get("adapters") if isinstance(lora, dict) else None
    loaded = [a for a in entries or () if isinstance(a, dict) and a.get("resident")]
    return [str(a["lora_name"]) for a in sorted(loaded, key=lambda a: not a.get("pinned"))]


def restore(url: str, info: Mapping[str, Any], at_start: Sequence[str]) -> int:
    """Make the adapters `at_start` the ones loaded on the worker at `url` (`info`: its
    server info now), in that order; the adapters reloaded. RuntimeError naming the adapter a
    worker refused."""
    now = resident(info)
    if now == list(at_start):
        return 0
    by_name = {a.name: a for a in registered(info)}
    others = [name for name in now if name not in at_start]
    for name in dict.fromkeys([*now, *at_start]):
        _post(url, "/unload_lora_adapter", {"lora_name": name})
    for name in [*others, *at_start]:
        a = by_name[name]
        _post(
            url,
            "/load_lora_adapter",
            {"lora_name": a.name, "lora_path": a.path, "pinned": a.pinned},
        )
    return len(others) + len(at_start)


def _post(url: str, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), JSON_HEADERS)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise RuntimeError(f"{url}{path} {body.get('lora_name')!r}: {exc.code} {detail}") from None

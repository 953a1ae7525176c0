"""LoRA adapters as SGLang serves them: named adapters, loaded and evicted, one per request.

Flags and endpoints keep SGLang's names and bodies: `--lora-paths` (`PATH`, `NAME=PATH`, or
JSON `{"lora_name", "lora_path", "pinned"}`), `--max-loaded-loras`, `--max-loras-per-batch`,
`--lora-eviction-policy lru|fifo`; `POST /load_lora_adapter {"lora_name", "lora_path",
"pinned"}` and `POST /unload_lora_adapter {"lora_name"}`, both answered with SGLang's
LoRAUpdateOutput `{"success", "error_message", "loaded_adapters": {name: path}}` (400 when
`success` is false).

Two levels, as in SGLang: the *registered* adapters (given by flag or loaded by the
endpoint; a request naming any other gets a 400) and, of those, the *resident* ones whose
weights are in memory, at most `--max-loaded-loras`. A request for a registered adapter that
is not resident loads it before its prefill, evicting a resident one that no running request
uses (least recently used, or first loaded with `fifo`; pinned adapters never); while none
can be evicted it waits, and the requests behind it go ahead (SGLang's scheduler skips it,
`continue`, rather than stop the queue there). A running batch holds at most
`--max-loras-per-batch` different adapters. Each registration gets a new `lora_id`
(SGLang's uuid), which keys the cache namespace: KV computed under an adapter is never
reused by another, nor by the same name loaded again from another path.

Weights: no backend applies real LoRA weights (`hf` runs the base model, keyed per adapter
all the same; `sim` models only the time). Loading costs the sim `LatencyModel.lora_load_s`
of the adapter's size (`--sim-lora-size-mb`), added to the step that prefills the request.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


class LoRAError(ValueError):
    """A refused adapter operation or request (answered with a 400)."""


@dataclass(slots=True)
class LoRARef:
    """One registered adapter (SGLang's LoRARef)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    loads: int = 0
    in_use: int = 0  # requests admitted with it and not finished


def parse_lora_path(spec: str) -> LoRARef:
    """One `--lora-paths` entry: `PATH`, `NAME=PATH` or JSON {lora_name, lora_path, pinned}."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise LoRAError(f"--lora-paths: {spec!r} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise LoRAError(f"--lora-paths: {spec!r} must be a JSON object")
        unknown = set(raw) - {"lora_name", "lora_path", "pinned"}
        if unknown:
            raise LoRAError(f"--lora-paths: unknown keys {sorted(unknown)} in {spec!r}")
        name, path, pinned = raw.get("lora_name"), raw.get("lora_path"), raw.get("pinned", False)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LoRAError(f"--lora-paths: {spec!r} needs 'lora_name' and 'lora_path' strings")
        if not isinstance(pinned, bool):
            raise LoRAError(f"--lora-paths: 'pinned' must be true or false in {spec!r}")
        return LoRARef(name, path, pinned)
    if "=" in spec:
        name, path = spec.split("=", 1)
    else:
        name = path = spec
    if not name or not path:
        raise LoRAError(f"--lora-paths: {spec!r} is not PATH, NAME=PATH or JSON")
    return LoRARef(name, path)


class LoRARegistry:
    """Registered and resident adapters of one worker."""

    def __init__(
        self,
        refs: list[LoRARef] | None = None,
        max_loaded: int | None = None,
        max_per_batch: int = 8,
        policy: str = "lru",
    ) -> None:
        if policy not in ("lru", "fifo"):
            raise LoRAError(f"--lora-eviction-policy must be lru or fifo, got {policy!r}")
        if max_per_batch < 1:
            raise LoRAError(f"--max-loras-per-batch must be >= 1, got {max_per_batch}")
        if max_loaded is not None and max_loaded < max_per_batch:
            raise LoRAError(
                f"--max-loaded-loras ({max_loaded}) must be >= --max-loras-per-batch "
                f"({max_per_batch}), as SGLang requires"
            )
        self.max_loaded = max_loaded
        self.max_per_batch = max_per_batch
        self.policy = policy
        self.refs: dict[str, LoRARef] = {}
        # Resident adapters by name, in eviction order (first: evicted first).
        self.resident: OrderedDict[str, float] = OrderedDict()
        self.loads = 0
        self.evictions = 0
        for ref in refs or []:
            self.register(ref, load=False)
        # Startup: the first max_loaded adapters (pinned first) are resident.
        for ref in sorted(self.refs.values(), key=lambda r: not r.pinned):
            if self.max_loaded is None or len(self.resident) < self.max_loaded:
                self.resident[ref.lora_name] = time.monotonic()
                ref.loads += 1

    @property
    def enabled(self) -> bool:
        return bool(self.refs)

    def loaded_adapters(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: name -> path of every registered adapter."""
        return {name: ref.lora_path for name, ref in self.refs.items()}

    def register(self, ref: LoRARef, load: bool = True) -> bool:
        """Add an adapter (and, with `load`, make it resident); returns whether it was loaded
        now. LoRAError when the name is taken or no room can be made."""
        if ref.lora_name in self.refs:
            raise LoRAError(
                f"The LoRA adapter with name {ref.lora_name!r} is already loaded; unload it first"
            )
        pinned = sum(1 for r in self.refs.values() if r.pinned)
        if ref.pinned and self.max_loaded is not None and pinned + 1 >= self.max_loaded:
            raise LoRAError(
                f"cannot pin {ref.lora_name!r}: {pinned} adapters are pinned and "
                f"--max-loaded-loras is {self.max_loaded} (one slot must stay for the others)"
            )
        if load and not self._room():
            raise LoRAError(
                f"cannot load {ref.lora_name!r}: {len(self.resident)} adapters are loaded "
                f"(--max-loaded-loras {self.max_loaded}) and every one is pinned or in use"
            )
        self.refs[ref.lora_name] = ref
        if load:
            self._make_resident(ref)
        return load

    def unregister(self, name: str) -> LoRARef:
        ref = self.refs.pop(name, None)
        if ref is None:
            raise LoRAError(f"The LoRA adapter with name {name!r} is not loaded")
        self.resident.pop(name, None)
        return ref

    def resolve(self, name: str) -> LoRARef:
        """The registered adapter a request names; LoRAError (a 400) for any other."""
        ref = self.refs.get(name)
        if ref is None:
            loaded = ", ".join(sorted(self.refs)) or "none"
            raise LoRAError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {loaded}."
            )
        return ref

    def _room(self) -> bool:
        """Whether one more adapter can be resident (evicting one if need be)."""
        if self.max_loaded is None or len(self.resident) < self.max_loaded:
            return True
        return self._victim() is not None

    def _victim(self) -> str | None:
        for name in self.resident:  # in eviction order
            ref = self.refs.get(name)
            if ref is None or (not ref.pinned and ref.in_use == 0):
                return name
        return None

    def _make_resident(self, ref: LoRARef) -> None:
        while self.max_loaded is not None and len(self.resident) >= self.max_loaded:
            victim = self._victim()
            if victim is None:
                raise LoRAError("no adapter can be evicted")
            del self.resident[victim]
            self.evictions += 1
        self.resident[ref.lora_name] = time.monotonic()
        ref.loads += 1
        self.loads += 1

    def is_resident(self, ref: LoRARef) -> bool:
        return self.refs.get(ref.lora_name) is ref and ref.lora_name in self.resident

    def acquire(self, ref: LoRARef, batch: set[str]) -> bool | None:
        """Admission of a request using `ref` into a batch whose adapters are `batch`:
        None when it cannot join now (the batch's adapter slots are full, or the adapter is
        not resident and none can be evicted); else whether it had to be loaded."""
        if ref.lora_name not in batch and len(batch) >= self.max_per_batch:
            return None
        loaded = False
        if ref.lora_name in self.resident:
            if self.policy == "lru":
                self.resident.move_to_end(ref.lora_name)
        elif self.refs.get(ref.lora_name) is ref:
            if not self._room():
                return None
            self._make_resident(ref)
            loaded = True
        ref.in_use += 1
        return loaded

    def release(self, ref: LoRARef) -> None:
        ref.in_use = max(ref.in_use - 1, 0)

    def info(self) -> dict[str, Any]:
        """/get_server_info's `lora` entry."""
        return {
            "max_loaded_loras": self.max_loaded,
            "max_loras_per_batch": self.max_per_batch,
            "lora_eviction_policy": self.policy,
            "loads": self.loads,
            "evictions": self.evictions,
            "adapters": [
                {
                    "lora_name": ref.lora_name,
                    "lora_path": ref.lora_path,
                    "lora_id": ref.lora_id,
                    "pinned": ref.pinned,
                    "resident": ref.lora_name in self.resident,
                    "in_use": ref.in_use,
                    "loads": ref.loads,
                }
                for ref in self.refs.values()
            ],
        }

"""A small local cluster of CPU workers, started when the router is given no worker URLs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from localrun.processes import (
    LOOPBACK,
    Launch,
    Server,
    free_port,
    module_command,
    start_all,
    stop_all,
)


def real_model_available() -> bool:
    """The hf backend needs torch and transformers; the sim backend needs neither."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class LocalCluster:
    """`count` workers on free loopback ports, each its own process, stopped by pid.

    Their output goes to the router's own stdout and stderr, where an operator sees it."""

    count: int = 2
    backend: str = "auto"
    extra_args: list[str] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def start(self, timeout_s: float = 300) -> list[str]:
        backend = self.backend
        if backend == "auto":
            backend = "hf" if real_model_available() else "sim"
        threads = max((os.cpu_count() or 2) // max(self.count, 1), 1)
        launches = []
        for instance in range(self.count):
            port = free_port()
            args = ["--backend", backend, "--instance-id", str(instance + 1), *self.extra_args]
            if backend == "hf":
                args += ["--threads", str(threads)]
            command = module_command("connector.worker", port, args)
            launches.append(Launch(f"local worker http://{LOOPBACK}:{port}", command, port))
        try:
            self.servers = start_all(launches, timeout_s)
        except RuntimeError as exc:
            raise SystemExit(str(exc)) from exc
        return self.urls

    def stop(self) -> None:
        stop_all(self.servers)

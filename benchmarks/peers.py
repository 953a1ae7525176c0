"""The peer routers the benchmarks compare ours with (sglang-router, smg): whether each can
run here, and the command line that starts one on a loopback port.

Nothing is installed by a benchmark: a peer that is not importable is skipped, and the
results say why.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

from localrun.processes import LOOPBACK, free_port

OURS = "memserve-router"
SGLANG_ROUTER = "sglang-router"
SMG = "smg"
PEER_MODULES = {SGLANG_ROUTER: "sglang_router", SMG: "smg"}


@dataclass
class PeerStatus:
    importable: bool
    version: str | None
    reason: str | None


def peer_status(package: str) -> PeerStatus:
    """Whether the PyPI `package` can be imported here, its version, or why not."""
    module = PEER_MODULES[package]
    why = f"{module} is not importable (pip install {package})"
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:
        found, why = False, f"{module} cannot be located: {exc}"
    if not found:
        return PeerStatus(False, None, why)
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return PeerStatus(True, version, None)


def peer_command(package: str, policy: str, port: int, grace_s: float) -> list[str]:
    """`launch_router` of `package` on `port` with `policy`, quiet, its metrics on a free
    loopback port (their default port would clash between runs); the caller adds workers."""
    args = [sys.executable, "-m", f"{PEER_MODULES[package]}.launch_router"]
    args += ["--host", LOOPBACK, "--port", str(port), "--policy", policy, "--log-level", "warn"]
    args += ["--prometheus-port", str(free_port()), "--prometheus-host", LOOPBACK]
    args += ["--shutdown-grace-period-secs", f"{grace_s:g}"]
    if package == SMG:
        args.append("--disable-tokenizer-autoload")  # else it fetches a tokenizer online
    return args

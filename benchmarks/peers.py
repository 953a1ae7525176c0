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


# sglang-router's launcher imports its debugging load balancer (mini_lb), which imports
# SGLang's tracing when SGLang is installed (the test extras install it): torch and
# transformers, about 7 s a start. mini_lb falls back when that import fails, and the Rust
# router never uses it, so the launch hides SGLang as a plain `pip install sglang-router`
# has it.
LAUNCH = "import sys; sys.modules['sglang'] = None; from {module}.launch_router import main; main()"


def peer_command(package: str, policy: str, port: int, grace_s: float) -> list[str]:
    """`launch_router` of `package` on `port` with `policy`, quiet, its metrics on a free
    loopback port (their default port would clash between runs); the caller adds workers."""
    args = [sys.executable, "-c", LAUNCH.format(module=PEER_MODULES[package])]
    args += ["--host", LOOPBACK, "--port", str(port), "--policy", policy, "--log-level", "warn"]
    args += ["--prometheus-port", str(free_port()), "--prometheus-host", LOOPBACK]
    args += ["--shutdown-grace-period-secs", f"{grace_s:g}"]
    if package == SMG:
        args.append("--disable-tokenizer-autoload")  # else it fetches a tokenizer online
    return args

"""A small local cluster of CPU workers, started when the router is given no worker URLs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """`count` workers on free loopback ports, each its own process, stopped by pid."""

    count: int = 2
    backend: str = "auto"
    extra_args: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 300) -> list[str]:
        backend = self.backend
        if backend == "auto":
            backend = "hf" if real_model_available() else "sim"
        threads = max((os.cpu_count() or 2) // max(self.count, 1), 1)
        for instance in range(self.count):
            port = _free_port()
            args = [
                sys.executable,
                "-m",
                "connector.worker",
                "--backend",
                backend,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--instance-id",
                str(instance + 1),
                *self.extra_args,
            ]
            if backend == "hf":
                args += ["--threads", str(threads)]
            self.procs.append(subprocess.Popen(args))
            self.urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for proc, url in zip(self.procs, self.urls, strict=True):
            while True:
                if proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"local worker {url} exited with {proc.returncode}")
                with (
                    contextlib.suppress(OSError),
                    urllib.request.urlopen(url + "/health", timeout=1) as resp,
                ):
                    if resp.status == 200:
                        break
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"local worker {url} not healthy after {timeout_s}s")
                time.sleep(0.2)
        return self.urls

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

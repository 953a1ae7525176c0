"""What every benchmark shares: its command line, its event loop, progress bars, and how
paths, commands and numbers may appear in a result. The result files themselves are
`benchmarks.report`; starting and stopping server processes is `localrun.processes`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import signal
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Servers a benchmark starts never download anything.
# No downloads; one router process unless a benchmark asks for more (--processes).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "MEMSERVE_ROUTER_PROCESSES": "1"}

T = TypeVar("T")


def shown_path(path: Path | str) -> str:
    """A path as results may show it: relative to the repository when inside it, else only
    its file name (where this machine keeps a file is no part of a figure)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return path.name if path.is_absolute() else str(path)


def without_home(text: str) -> str:
    """`text` with this machine's home directory shown as `~`: a server's message in a
    result may name a file under it (a model's path as its id)."""
    home = str(Path.home()) + os.sep
    return text.replace(home, "~" + os.sep)


def shown_command(prefix: str, argv: Sequence[str]) -> str:
    """A command line as results may show it, one a shell runs as it stands: its absolute
    paths as `shown_path` gives them, each word quoted where it needs to be."""

    def shown(word: str) -> str:
        flag, eq, value = word.partition("=")
        if eq and value.startswith("/"):
            return f"{flag}={shown_path(value)}"
        return shown_path(word) if word.startswith("/") else word

    return " ".join([prefix, *(shlex.quote(shown(word)) for word in argv)])


def jsonable(value: Any) -> Any:
    """Non-finite floats become None: json would otherwise emit NaN, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def finite(value: Any) -> TypeGuard[float]:
    """A real number to show: not None, not a bool, not NaN or infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rss_mib(pid: int) -> float | None:
    """VmRSS of a process in MiB (/proc: what the kernel counts resident, shared pages
    included); None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("VmRSS:")[1].split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """Every descendant's pid (children of every thread, recursively)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError, ValueError):
                kids = [int(x) for x in (task / "children").read_text().split()]
                found.extend(kids)
                todo.extend(kids)
    return found


def progress_bar(width: int = 38) -> Progress:
    """Progress on stderr; no refresh thread, so nothing competes with the timed loops."""
    return Progress(
        TextColumn(f"[bold]{{task.description:<{width}}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        auto_refresh=False,
    )


def step(progress: Progress, task: TaskID) -> None:
    progress.advance(task)
    progress.refresh()


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """uvloop when installed (as the routers and workers run), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def parse_args(
    argv: Sequence[str] | None,
    description: str,
    quick_help: str,
    parents: Sequence[argparse.ArgumentParser] = (),
) -> argparse.Namespace:
    """The flags every benchmark takes: `--out DIR` (required) and `--quick`; a benchmark's
    own flags come in `parents` (parsers made with add_help=False)."""
    parser = argparse.ArgumentParser(description=description, parents=list(parents))
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    return parser.parse_args(argv)


def stop_children_on_terminate() -> None:
    """SIGTERM unwinds like Ctrl-C, so the `finally` blocks that stop the servers a
    benchmark started run (killed plainly, it left its workers and routers behind)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def benchmark_main(
    argv: Sequence[str] | None,
    name: str,
    doc: str | None,
    run: Callable[..., dict[str, Any]],
    quick_help: str,
    summary_end: str = "\n## Notes",
    extra: argparse.ArgumentParser | None = None,
) -> int:
    """`python -m benchmarks.<name> --out DIR [--quick]`: run, then print where the files
    went and the Markdown page up to `summary_end` (the headline tables). `extra`: the
    benchmark's own flags (add_help=False), passed to `run` by their dest names."""
    parents = [extra] if extra is not None else []
    args = parse_args(argv, (doc or name).splitlines()[0], quick_help, parents)
    own = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    stop_children_on_terminate()
    started = time.perf_counter()
    figures = run(args.out, args.quick, **own)
    wall = time.perf_counter() - started
    print(f"{name}: {figures['mode']} run, {wall:.1f} s including the plot -> {args.out}")
    print((args.out / f"{name}.md").read_text().split(summary_end)[0])
    return 0

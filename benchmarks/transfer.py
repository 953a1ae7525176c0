"""Transfer benchmark: one request's KV cache moved between two MemPools on loopback.

A raw socket copy (the ceiling of a socket data plane), our TcpTransport and Mooncake's engine
move the same request from this process to a child, every transfer CRC-checked; with Mooncake
installed the run moves into a private network namespace (Mooncake listens on every interface).
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing
import socket
import statistics
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from benchmarks.harness import benchmark_main, percentile, progress_bar, step
from benchmarks.report.figures import pyplot, save
from benchmarks.report.page import write_results
from benchmarks.report.table import rounded, table_section
from mempool import KVBlockSpec, Layout, MemPool, MemType
from mempool.transfer.base import DataTransport, PeerInfo, Segment
from mempool.transfer.rdma import coalesce

NAME = "transfer"
TOKENS = 2048
PAGE = 16
HOST = int(MemType.HOST)
SEED = 20240627
MODELS: dict[str, KVBlockSpec] = {
    "SmolLM2-135M": KVBlockSpec(
        layers=30, kv_heads=3, head_dim=64, dtype="float16", page_size=PAGE
    ),
    "Llama-2-13B": KVBlockSpec(
        layers=40, kv_heads=40, head_dim=128, dtype="float16", page_size=PAGE
    ),
}
TARGET_RAW_FRACTION = 0.70
TCP_STREAMS = 4
_ACK = b"\x01"
_LEN = struct.Struct("<Q")


@dataclass(frozen=True)
class Settings:
    """Repetitions, and the tokens per model (quick mode shrinks the 1.68 GB request)."""

    quick: bool
    reps: int
    tokens: dict[str, int]


QUICK = Settings(True, 3, {"SmolLM2-135M": TOKENS, "Llama-2-13B": 256})
FULL = Settings(False, 7, {"SmolLM2-135M": TOKENS, "Llama-2-13B": TOKENS})


@dataclass(frozen=True)
class Case:
    """One way of moving the request."""

    key: str
    system: str  # "raw", "tcp" or "mooncake"
    layout: Layout
    merge: bool = False
    op: str = "write"

    @property
    def label(self) -> str:
        if self.system == "raw":
            return "raw socket copy"
        shape = "merged" if self.merge else self.layout.value
        pull = " read" if self.op == "read" else ""
        return f"{self.system} {shape}{pull}"


CASES: tuple[Case, ...] = (
    Case("raw_socket", "raw", Layout.AGGREGATED),
    *(
        c
        for system in ("tcp", "mooncake")
        for c in (
            Case(f"{system}_discrete", system, Layout.DISCRETE),
            Case(f"{system}_aggregated", system, Layout.AGGREGATED),
            Case(f"{system}_merged", system, Layout.DISCRETE, merge=True),
            Case(f"{system}_aggregated_read", system, Layout.AGGREGATED, op="read"),
        )
    ),
)


def make_pool(instance: int, spec: KVBlockSpec, layout: Layout, tokens: int) -> MemPool:
    """A pool holding exactly one request: its arena is the request's bytes."""
    blocks = tokens // spec.page_size * spec.blocks_per_page(layout)
    return MemPool(instance, spec, host_blocks=blocks, layout=layout)


def request_segments(pool: MemPool) -> list[Segment]:
    """Every block of the (full) pool to the same offset on the peer: both pools allocate in
    the same order, so the destination arena must end up equal to the source's."""
    addrs = pool.alloc_blocks(pool.allocators[MemType.HOST].num_blocks)
    offsets = (pool.offset_of(addr)[1] for addr in addrs)
    return [Segment(HOST, offset, HOST, offset, pool.block_size) for offset in offsets]


def systems(mooncake: bool) -> tuple[str, ...]:
    return ("tcp", "mooncake") if mooncake else ("tcp",)


def transport(system: str, pool: MemPool) -> DataTransport:
    """Our TcpTransport or Mooncake's engine on `pool`; the benchmark decides what is merged."""
    if system == "tcp":
        from mempool.transfer.tcp import TcpTransport

        return TcpTransport(pool, "127.0.0.1", 0, streams=TCP_STREAMS)
    from mempool.transfer.mooncake import MooncakeConfig, MooncakeTransport

    return MooncakeTransport(pool, MooncakeConfig(merge=False))


def fill_random(view: memoryview, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    chunk = 64 << 20
    for start in range(0, len(view), chunk):
        n = min(chunk, len(view) - start)
        view[start : start + n] = rng.bytes(n)


def zero(view: memoryview) -> None:
    ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(view)), 0, len(view))


def mooncake_status() -> tuple[bool, str | None]:
    """Whether Mooncake can run here, isolated; enters the private namespace when it can."""
    from mempool.transfer.mooncake import MooncakeUnavailable, enter_private_network, load_engine

    try:
        load_engine()
    except MooncakeUnavailable as exc:
        return False, str(exc)

    try:
        enter_private_network()
    except OSError as exc:
        return False, f"Mooncake listens on every interface and {exc}: not run"
    return True, None


# --------------------------------------------------------------------------- receiver


class Receiver:
    """The child process: the receiving pools, their transports, and a raw socket sink."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pools: dict[Layout, MemPool] = {}
        self.transports: list[DataTransport] = []
        self.raw_listener: socket.socket | None = None
        self.raw_target: memoryview | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            cmd, *args = await loop.run_in_executor(None, self.conn.recv)
            try:
                result = await getattr(self, f"cmd_{cmd}")(*args)
            except Exception as exc:  # reported to the parent, which stops the run
                self.conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            self.conn.send(("ok", result))
            if cmd == "exit":
                return

    async def cmd_setup(self, spec: KVBlockSpec, tokens: int, mooncake: bool) -> dict[str, Any]:
        await self.cmd_teardown()
        out: dict[str, Any] = {}
        for instance, layout in ((2, Layout.DISCRETE), (3, Layout.AGGREGATED)):
            pool = make_pool(instance, spec, layout, tokens)
            request_segments(pool)  # allocate everything, as the sender does
            self.pools[layout] = pool
            endpoints: dict[str, Any] = {}
            for system in systems(mooncake):
                receiving = transport(system, pool)
                endpoints[system] = await receiving.start()
                self.transports.append(receiving)
            out[layout.value] = {"instance": instance, "endpoints": endpoints}
        self.raw_target = self.pools[Layout.AGGREGATED].region(MemType.HOST)
        self.raw_listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._raw_sink, args=(self.raw_listener,), daemon=True).start()
        out["raw_port"] = self.raw_listener.getsockname()[1]
        return out

    def _raw_sink(self, listener: socket.socket) -> None:
        """Receive length-prefixed copies straight into the aggregated arena; ack each."""
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                header = sock.recv(_LEN.size, socket.MSG_WAITALL)
                if len(header) < _LEN.size:
                    return
                (length,) = _LEN.unpack(header)
                assert self.raw_target is not None
                view = self.raw_target[:length]
                got = 0
                while got < length:  # MSG_WAITALL: the kernel fills it in as few calls as it can
                    n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                    if not n:
                        return
                    got += n
                sock.sendall(_ACK)

    async def cmd_zero(self, layout: str) -> None:
        zero(self.pools[Layout(layout)].region(MemType.HOST))

    async def cmd_crc(self, layout: str) -> int:
        view = self.pools[Layout(layout)].region(MemType.HOST)
        return await asyncio.get_running_loop().run_in_executor(None, zlib.crc32, view)

    async def cmd_teardown(self) -> None:
        for t in self.transports:
            await t.close()
        self.transports.clear()
        if self.raw_listener is not None:
            self.raw_listener.close()
            self.raw_listener = None
        self.raw_target = None
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    cmd_exit = cmd_teardown


def receiver_main(conn: Connection) -> None:
    asyncio.run(Receiver(conn).run())


class Remote:
    """The parent's handle on the receiver process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"receiver: {result}")
        return result

    def close(self) -> None:
        try:
            self.call("exit")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


# --------------------------------------------------------------------------- sender


@dataclass
class Sample:
    seconds: float
    calls: int
    verified: bool


class Sender:
    """This process's pools and transports for one model, and how each case is run."""

    def __init__(self, spec: KVBlockSpec, tokens: int, remote: Remote, mooncake: bool) -> None:
        self.remote = remote
        self.pools: dict[Layout, MemPool] = {}
        self.segments: dict[Layout, list[Segment]] = {}
        self.src_crc: dict[Layout, int] = {}
        self.transports: dict[tuple[str, Layout], DataTransport] = {}
        self.peers: dict[Layout, PeerInfo] = {}
        info = remote.call("setup", spec, tokens, mooncake)
        for i, layout in enumerate((Layout.DISCRETE, Layout.AGGREGATED)):
            pool = make_pool(10 + i, spec, layout, tokens)
            self.pools[layout] = pool
            self.segments[layout] = request_segments(pool)
            region = pool.region(MemType.HOST)
            fill_random(region, SEED + i)
            self.src_crc[layout] = zlib.crc32(region)
            peer = info[layout.value]
            self.peers[layout] = PeerInfo(peer["instance"], "127.0.0.1", 0, (), peer["endpoints"])
            for system in systems(mooncake):
                self.transports[(system, layout)] = transport(system, pool)
        self.raw = socket.create_connection(("127.0.0.1", info["raw_port"]))
        self.raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def start(self) -> None:
        for (_, layout), moving in self.transports.items():
            await moving.start()
            warm = self.segments[layout][:1]  # connect and touch the path once, untimed
            await moving.write(self.peers[layout], warm)

    def raw_copy(self) -> float:
        view = self.pools[Layout.AGGREGATED].region(MemType.HOST)
        t0 = time.perf_counter()
        self.raw.sendall(_LEN.pack(len(view)))
        self.raw.sendall(view)
        if self.raw.recv(1) != _ACK:
            raise RuntimeError("raw copy: no acknowledgement")
        return time.perf_counter() - t0

    async def run(self, case: Case) -> Sample:
        """One transfer into a zeroed destination, then its CRC against the source's; a read
        pulls the peer's copy (the case before wrote it) over our own."""
        layout = case.layout
        region = self.pools[layout].region(MemType.HOST)
        reading = case.op == "read"
        if reading:
            zero(region)
        else:
            self.remote.call("zero", layout.value)
        if case.system == "raw":
            seconds, calls = self.raw_copy(), 1
        else:
            moving = self.transports[(case.system, layout)]
            move, peer = getattr(moving, case.op), self.peers[layout]
            segs = coalesce(self.segments[layout]) if case.merge else self.segments[layout]
            before = moving.calls
            t0 = time.perf_counter()
            await move(peer, segs)
            seconds = time.perf_counter() - t0
            calls = moving.calls - before
        got = zlib.crc32(region) if reading else self.remote.call("crc", layout.value)
        return Sample(seconds, calls, got == self.src_crc[layout])

    async def close(self) -> None:
        self.raw.close()
        for moving in self.transports.values():
            await moving.close()
        for pool in self.pools.values():
            pool.close()
        self.remote.call("teardown")


# --------------------------------------------------------------------------- summary


def summarize(samples: list[Sample], nbytes: int) -> dict[str, Any]:
    rates = [nbytes / s.seconds / 1e9 for s in samples]
    calls = {s.calls for s in samples}
    return {
        "gbps_median": statistics.median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "gbps_p25": percentile(rates, 0.25),
        "gbps_p75": percentile(rates, 0.75),
        "gbps": rates,
        "seconds_median": statistics.median(s.seconds for s in samples),
        "calls": calls.pop() if len(calls) == 1 else sorted(calls),
        "verified": all(s.verified for s in samples),
        "reps": len(samples),
    }


def ratios(cases: dict[str, Any], layers: int) -> dict[str, Any]:
    """Ratios of median GB/s (NaN where a case did not run), of call counts, and the targets."""

    def gbps(key: str) -> float:
        return cases[key]["gbps_median"] if key in cases else math.nan

    tcp = gbps("tcp_aggregated")
    pushed = (gbps(k) for k in cases if k.startswith("mooncake") and "read" not in k)
    out: dict[str, Any] = {
        "tcp_aggregated_over_raw": tcp / gbps("raw_socket"),
        "tcp_aggregated_over_mooncake_aggregated": tcp / gbps("mooncake_aggregated"),
        "tcp_aggregated_over_mooncake_best": tcp / max(pushed, default=math.nan),
        "tcp_merged_over_raw": gbps("tcp_merged") / gbps("raw_socket"),
        "tcp_aggregated_over_discrete": tcp / gbps("tcp_discrete"),
    }
    for system in ("tcp", "mooncake"):
        d, a = cases.get(f"{system}_discrete"), cases.get(f"{system}_aggregated")
        if d and a:
            out[f"{system}_discrete_over_aggregated_calls"] = d["calls"] / a["calls"]
    raw, mooncake = out["tcp_aggregated_over_raw"], out["tcp_aggregated_over_mooncake_aggregated"]
    calls = out["tcp_discrete_over_aggregated_calls"]
    out["targets"] = {
        key: {"target": limit, "value": value, "met": met}
        for key, limit, value, met in (
            ("tcp_aggregated_over_raw", TARGET_RAW_FRACTION, raw, raw >= TARGET_RAW_FRACTION),
            ("tcp_aggregated_over_mooncake_aggregated", 1.0, mooncake, mooncake >= 1.0),
            ("discrete_over_aggregated_calls", 2 * layers, calls, calls == 2 * layers),
        )
    }
    return out


def plot(path: Path, models: dict[str, Any]) -> None:
    """Median GB/s per case and model, whiskers from the slowest to the fastest repetition."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(models), figsize=(6.2 * len(models), 4.8), squeeze=False)
    colours = {"raw": "0.45", "tcp": "C0", "mooncake": "C1"}
    for ax, (name, model) in zip(axes[0], models.items(), strict=True):
        cases = [c for c in CASES if c.key in model["cases"]]
        med = [model["cases"][c.key]["gbps_median"] for c in cases]
        lo = [m - model["cases"][c.key]["gbps_min"] for c, m in zip(cases, med, strict=True)]
        hi = [model["cases"][c.key]["gbps_max"] - m for c, m in zip(cases, med, strict=True)]
        y = range(len(cases))
        ax.barh(y, med, xerr=[lo, hi], color=[colours[c.system] for c in cases], capsize=3)
        ax.set_yticks(list(y), [f"{c.label} ({model['cases'][c.key]['calls']:,})" for c in cases])
        ax.invert_yaxis()
        raw = model["cases"]["raw_socket"]["gbps_median"]
        ax.axvline(raw * TARGET_RAW_FRACTION, color="k", ls=":", lw=0.8, label="70 % of raw copy")
        ax.set(
            xlabel="GB/s (median; whiskers: min-max)",
            title=f"{name}: {model['tokens']:,} tokens, {model['bytes'] / 1e6:,.0f} MB",
        )
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("One request's KV between two MemPools on loopback (calls in parentheses)")
    fig.tight_layout()
    save(fig, path, dpi=120)


# --------------------------------------------------------------------------- run


async def measure(settings: Settings, mooncake: bool) -> dict[str, Any]:
    """Every case on each model, interleaved (drifts hit every case alike), summarised."""
    cases = [c for c in CASES if c.system != "mooncake" or mooncake]
    models: dict[str, Any] = {}
    remote = Remote()
    try:
        with progress_bar(30) as progress:
            for name, spec in MODELS.items():
                tokens = settings.tokens[name]
                total = settings.reps * len(cases)
                task = progress.add_task(f"{name}, {tokens} tokens", total=total)
                progress.refresh()
                sender = Sender(spec, tokens, remote, mooncake)
                samples: dict[str, list[Sample]] = {c.key: [] for c in cases}
                try:
                    await sender.start()
                    for _ in range(settings.reps):
                        for case in cases:
                            samples[case.key].append(await sender.run(case))
                            step(progress, task)
                finally:
                    await sender.close()
                nbytes = tokens * spec.bytes_per_token
                shape = ("layers", "kv_heads", "head_dim", "dtype", "page_size")
                summary = {k: summarize(v, nbytes) for k, v in samples.items()}
                models[name] = {
                    **{k: getattr(spec, k) for k in shape},
                    "tokens": tokens,
                    "bytes": nbytes,
                    "pages": tokens // spec.page_size,
                    "cases": summary,
                    "ratios": ratios(summary, spec.layers),
                }
    finally:
        remote.close()
    return models


def table_rows(models: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "model": name,
            "case": case.label,
            "network calls": c["calls"],
            "MB": round(model["bytes"] / 1e6, 1),
            "GB/s median": round(c["gbps_median"], 3),
            "min": round(c["gbps_min"], 3),
            "max": round(c["gbps_max"], 3),
            "verified": c["verified"],
        }
        for name, model in models.items()
        for case in CASES
        if (c := model["cases"].get(case.key)) is not None
    ]


def ratio_rows(models: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets (value, bound, met), then the other ratios (values alone)."""
    rows: list[dict[str, Any]] = []
    others = (
        "tcp_merged_over_raw",
        "tcp_aggregated_over_mooncake_best",
        "mooncake_discrete_over_aggregated_calls",
    )
    for name, model in models.items():
        for key, t in model["ratios"]["targets"].items():
            bound = f"{'==' if 'calls' in key else '>='} {t['target']}"
            value = rounded(t["value"], 3)
            rows.append(
                {"model": name, "figure": key, "value": value, "target": bound, "met": t["met"]}
            )
        for key in others:
            if key in model["ratios"]:
                rows.append(
                    {"model": name, "figure": key, "value": rounded(model["ratios"][key], 3)}
                )
    return rows


def run(out: Path, quick: bool) -> dict[str, Any]:
    """Every case on both models, then the JSON, Markdown and PNG files; returns the figures."""
    settings = QUICK if quick else FULL
    # Before any thread exists: only the calling thread changes namespace.
    mooncake, why_not = mooncake_status()
    started = time.perf_counter()
    # asyncio's own loop on both ends, as the published figures were measured (not the
    # harness's uvloop: a different loop would change what is compared with them).
    models = asyncio.run(measure(settings, mooncake))
    figures: dict[str, Any] = {
        "mode": "quick" if settings.quick else "full",
        "reps": settings.reps,
        "tcp_streams": TCP_STREAMS,
        "network": "private network namespace, loopback only" if mooncake else "loopback",
        "mooncake": {"available": mooncake, "reason": why_not},
        "models": models,
        "elapsed_s": time.perf_counter() - started,
    }
    notes = [
        f"{settings.reps} repetitions, cases interleaved; GB/s = request bytes / wall time of "
        "one write (or read) call until it returned, the peer's acknowledgement included.",
        "Sender pool in this process, receiver pool in a child process; every transfer "
        "verified (destination zeroed before, CRC-32 equal to the source's after).",
        "Network calls: work items the transport was handed (TCP: segments; Mooncake: batch "
        "entries; raw copy: one sendall).",
        "merged = discrete blocks sorted and joined by merge_segments: a fresh pool hands "
        "out blocks in descending address order, so merge_segments alone joins nothing.",
        f"The raw copy is one connection; TcpTransport splits a request over {TCP_STREAMS} "
        "streams (two cores here), which is how it can beat the raw copy.",
        "Mooncake: batch_transfer_sync_* from a worker thread, at most 1,024 entries per "
        "batch (larger batches to one peer fail in 0.3.13); it busy-polls its batch status, "
        "which costs it one of the two cores while it waits, and a single large entry (merged) "
        "does not go faster than many page-sized ones.",
        "Every case ran inside a private network namespace (loopback only), because "
        "Mooncake's listeners bind every interface."
        if mooncake
        else f"Mooncake not measured: {why_not}",
    ]
    title = "MemPool transfers on loopback"
    ratio_table = table_section("Ratios and targets", ratio_rows(models))
    write_results(out, NAME, figures, table_rows(models), title, notes, body=ratio_table)
    plot(out / f"{NAME}.png", models)
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    quick = "fewer repetitions, smaller Llama request"
    return benchmark_main(argv, NAME, __doc__, run, quick)


if __name__ == "__main__":
    raise SystemExit(main())

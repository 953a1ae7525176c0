"""Attacks on the router's HTTP server over raw sockets: endless heads, long lines, too many
headers, a byte a second, idle connections, a pipelined flood, bodies over the limit. Each
row passes when the router answered as its limits say (or closed in time), kept serving,
and its RSS did not grow with what was sent."""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable, Iterator

from benchmarks.harness import rss_mib
from benchmarks.reliability.cluster import Cluster
from benchmarks.reliability.report import HEADER_TIMEOUT_S, MAX_PAYLOAD, LimitResult

ENDLESS_MIB = 200  # the attack: one header of this many MiB that never ends
HEALTH = b"GET /health HTTP/1.1\r\nHost: r\r\n"
POST = b"POST /generate HTTP/1.1\r\nHost: r\r\n"
CHUNK = b"a" * 65536
Attack = Callable[[int], tuple[str, str]]  # on the router's port: (what was sent, answer)


@contextlib.contextmanager
def connection(port: int) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", port), timeout=30.0) as sock:
        yield sock


def status_of(sock: socket.socket, wait_s: float = 10.0) -> str:
    """The status line's code, 'closed' when the router closed without one, or 'open'."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while b"\r\n" not in data and (more := sock.recv(4096)):
            data += more
    except TimeoutError:
        return "open"
    except ConnectionResetError:
        return "closed (reset)"
    return data.split(b"\r\n", 1)[0].split(b" ")[1].decode() if data else "closed"


def send_until_refused(sock: socket.socket, head: bytes, filler: bytes, limit: int) -> int:
    """`head`, then `filler` up to `limit` bytes or until the router stops reading (for 5 s)
    or closes; the bytes sent."""
    sent = 0
    sock.settimeout(5.0)
    with contextlib.suppress(ConnectionResetError, BrokenPipeError, TimeoutError):
        sock.sendall(head)
        while sent < limit:
            sock.sendall(filler)
            sent += len(filler)
    return sent


def serving(port: int) -> bool:
    try:
        with connection(port) as sock:
            sock.sendall(HEALTH + b"\r\n")
            return status_of(sock) == "200"
    except OSError:
        return False


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def sent_once(what: str, raw: bytes) -> Attack:
    """The attack that sends `raw` at once, then reads the status line."""

    def attack(port: int) -> tuple[str, str]:
        with connection(port) as sock:
            sock.sendall(raw)
            return what, status_of(sock)

    return attack


def flooded(what: str, head: bytes, filler: bytes, limit: int) -> Attack:
    """The attack that sends `head` then `filler` until refused, then reads the status line."""

    def attack(port: int) -> tuple[str, str]:
        with connection(port) as sock:
            sent = send_until_refused(sock, head, filler, limit)
            return f"{what}; {mib(sent)} sent", status_of(sock)

    return attack


def endless_headers_8(port: int) -> tuple[str, str]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connection(port)) for _ in range(8)]
        sent = [send_until_refused(s, POST + b"X-Endless: ", CHUNK, 32 * 2**20) for s in socks]
        answers = "/".join(sorted({status_of(s) for s in socks}))
        return f"8 connections, each an endless header; {mib(max(sent))} sent at most", answers


def trickle(port: int) -> tuple[str, str]:
    """A byte a second (slowloris): closed at the header-read timeout."""
    with connection(port) as sock:
        began = time.monotonic()
        sock.settimeout(1.0)
        closed = False
        for byte in HEALTH + b"X-Slow: " + b"s" * 100:
            try:
                sock.sendall(bytes([byte]))
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue  # nothing back: the next byte
            except (ConnectionResetError, BrokenPipeError):
                closed = True
            if closed:
                break
        took = time.monotonic() - began
        return (
            "a head trickled a byte a second",
            f"{'closed' if closed else 'open'} after {took:.1f} s",
        )


def idle(port: int) -> tuple[str, str]:
    with connection(port) as sock:
        sock.sendall(HEALTH + b"\r\n")
        first = status_of(sock)
        began = time.monotonic()
        sock.settimeout(HEADER_TIMEOUT_S + 10)
        try:
            while sock.recv(4096):
                pass
            after = f"closed after {time.monotonic() - began:.1f} s idle"
        except TimeoutError:
            after = "open"
        return "a keep-alive connection left idle after one answer", f"{first}, then {after}"


def pipelined_flood(port: int) -> tuple[str, str]:
    """Requests pipelined without reading a single answer: reading must pause."""
    with connection(port) as sock:
        sent = send_until_refused(sock, b"", (HEALTH + b"\r\n") * 1024, 256 * 2**20)
        answer = "reading paused" if sent < 256 * 2**20 else "all read"
        return f"GET /health pipelined, no answer read; {mib(sent)} sent", answer


def closed_in_time(answer: str) -> bool:
    return answer.startswith("closed") and float(answer.split()[2]) <= HEADER_TIMEOUT_S + 1


def one_of(*answers: str) -> Callable[[str], bool]:
    return lambda answer: answer in answers


endless_header = flooded(
    f"a header of up to {ENDLESS_MIB} MiB, never ended",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Endless: ",
    CHUNK,
    ENDLESS_MIB * 2**20,
)
long_line = b"GET /health?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: r\r\n\r\n"
long_request_line = sent_once("a 9 KiB request line", long_line)
long_header = sent_once("one 9 KiB header", HEALTH + b"X-Big: " + b"b" * 9000 + b"\r\n\r\n")
headers_500 = HEALTH + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n"
declared_body = sent_once(
    "Content-Length 10 GiB (limit 1 MiB), 64 KiB of it sent",
    POST + b"Content-Length: 10737418240\r\n\r\n{" + CHUNK,
)
chunked_body = flooded(
    "a chunked body without end (limit 1 MiB)",
    POST + b"Transfer-Encoding: chunked\r\n\r\n",
    b"10000\r\n" + CHUNK + b"\r\n",
    64 * 2**20,
)
# (name, attack, expected answer, whether an answer passes)
ATTACKS: list[tuple[str, Attack, str, Callable[[str], bool]]] = [
    ("endless header", endless_header, "431 or closed", one_of("431", "closed")),
    ("endless headers x8", endless_headers_8, "431 or closed", lambda a: "open" not in a),
    ("long request line", long_request_line, "400 JSON", one_of("400")),
    ("long header", long_header, "431 JSON", one_of("431")),
    ("too many headers", sent_once("500 short headers", headers_500), "431", one_of("431")),
    ("slowloris", trickle, f"closed within {HEADER_TIMEOUT_S:g} s + 1", closed_in_time),
    ("idle keep-alive", idle, "200, then closed", lambda a: a.startswith("200, then closed")),
    ("pipelined flood", pipelined_flood, "reading paused", one_of("reading paused")),
    ("declared body over the limit", declared_body, "413 JSON", one_of("413")),
    ("chunked body over the limit", chunked_body, "413 JSON", one_of("413")),
]


def http_limits(c: Cluster) -> list[LimitResult]:
    """Every attack, one after the other, on a router with the limits the notes name."""
    limits = ["--max-payload-size", str(MAX_PAYLOAD), "--header-read-timeout-secs"]
    router = c.colocated_router(c.workers(1), *limits, str(HEADER_TIMEOUT_S))
    pid, port = router.proc.pid, router.port
    results = []
    for name, attack, expected, ok in ATTACKS:
        before = rss_mib(pid) or math.nan  # nan: the router is gone
        began = time.monotonic()
        try:
            sent, answer = attack(port)
        except OSError as exc:
            sent, answer = "(the attack broke)", f"{type(exc).__name__}: {exc}"
        took = round(time.monotonic() - began, 2)
        time.sleep(0.5)  # what the connection held is released
        after = rss_mib(pid) or math.nan
        results.append(
            LimitResult(
                name, sent, answer, expected, ok(answer), before, after, serving(port), took
            )
        )
    return results

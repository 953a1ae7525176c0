"""What an attacker may send to the router's HTTP server, on raw sockets: endless heads,
long lines, too many headers, bytes trickled one a second, idle connections, a flood of
pipelined requests, bodies over the limit.

Each row passes when the router answered as its limits say (or closed the connection
within its timeout), kept serving, and its memory did not grow with what was sent (RSS of
the router's process before and after, within `RSS_SLACK_MIB`).
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import rss_mib
from localrun.processes import Server

HEADER_TIMEOUT_S = 3.0  # the router's --header-read-timeout-secs in these rows
RSS_SLACK_MIB = 16.0  # growth allowed (allocator noise), against hundreds of MiB sent
ENDLESS_MIB = 200  # the attack: one header of this many MiB that never ends
CONNECT_S = 30.0


@dataclass
class LimitResult:
    """One attack on the router's HTTP layer and what came of it."""

    attack: str
    sent: str
    answer: str
    expected: str
    passed: bool
    rss_before_mib: float
    rss_after_mib: float
    still_serving: bool
    seconds: float

    @property
    def rss_kept(self) -> bool:
        return self.rss_after_mib - self.rss_before_mib <= RSS_SLACK_MIB

    @property
    def verdict(self) -> bool:
        return self.passed and self.still_serving and self.rss_kept

    def row(self) -> dict[str, Any]:
        return {
            "attack": self.attack,
            "sent": self.sent,
            "answer": self.answer,
            "expected": self.expected,
            "router RSS MiB before -> after": f"{self.rss_before_mib:.0f} -> "
            f"{self.rss_after_mib:.0f}",
            "verdict": "pass" if self.verdict else "FAIL",
        }

    def figures(self) -> dict[str, Any]:
        return {**vars(self), "rss_kept": self.rss_kept, "verdict": self.verdict}


Attack = Callable[[int], tuple[str, str]]  # on the router's port: (what was sent, answer)


@contextlib.contextmanager
def connection(port: int) -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=CONNECT_S) as sock:
        yield sock


def status_of(sock: socket.socket, wait_s: float = 10.0) -> str:
    """The status line's code, 'closed' when the router closed without one, or 'open'."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while b"\r\n" not in data:
            more = sock.recv(4096)
            if not more:
                break
            data += more
    except TimeoutError:
        return "open"
    except ConnectionResetError:
        return "closed (reset)"
    if not data:
        return "closed"
    return data.split(b"\r\n", 1)[0].split(b" ")[1].decode()


def send_until_refused(sock: socket.socket, head: bytes, filler: bytes, limit: int) -> int:
    """`head`, then `filler` again and again up to `limit` bytes or until the router stops
    reading (its socket buffers full for 5 s) or closes; the bytes sent."""
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
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
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


HEALTH = b"GET /health HTTP/1.1\r\nHost: r\r\n"
long_request_line = sent_once(
    "a 9 KiB request line", b"GET /health?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: r\r\n\r\n"
)
long_header = sent_once("one 9 KiB header", HEALTH + b"X-Big: " + b"b" * 9000 + b"\r\n\r\n")
many_headers = sent_once(
    "500 short headers", HEALTH + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n"
)
declared_body = sent_once(
    "Content-Length 10 GiB (limit 1 MiB), 64 KiB of it sent",
    b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: 10737418240\r\n\r\n{" + b"a" * 65536,
)


def endless_header(port: int) -> tuple[str, str]:
    with connection(port) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Endless: "
        sent = send_until_refused(sock, head, b"a" * 65536, ENDLESS_MIB * 2**20)
        return f"a header of up to {ENDLESS_MIB} MiB, never ended; {mib(sent)} sent", status_of(
            sock
        )


def endless_headers_8(port: int) -> tuple[str, str]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connection(port)) for _ in range(8)]
        head = b"POST /generate HTTP/1.1\r\nHost: r\r\nX-Endless: "
        sent = [send_until_refused(s, head, b"a" * 65536, 32 * 2**20) for s in socks]
        answers = sorted({status_of(s) for s in socks})
        return f"8 connections, each an endless header; {mib(max(sent))} sent at most", "/".join(
            answers
        )


def trickle(port: int) -> tuple[str, str]:
    """A byte a second (slowloris): closed at the header-read timeout."""
    with connection(port) as sock:
        began = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: r\r\nX-Slow: " + b"s" * 100
        sock.settimeout(1.0)
        closed = False
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue  # nothing back: the next byte
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
        took = time.monotonic() - began
        return "a head trickled a byte a second", (
            f"closed after {took:.1f} s" if closed else f"open after {took:.1f} s"
        )


def idle(port: int) -> tuple[str, str]:
    with connection(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
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
        one = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
        sent = send_until_refused(sock, b"", one * 1024, 256 * 2**20)
        paused = sent < 256 * 2**20
        return f"GET /health pipelined, no answer read; {mib(sent)} sent", (
            "reading paused" if paused else "all read"
        )


def chunked_body(port: int) -> tuple[str, str]:
    with connection(port) as sock:
        head = b"POST /generate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"10000\r\n" + b"a" * 65536 + b"\r\n"
        sent = send_until_refused(sock, head, chunk, 64 * 2**20)
        return f"a chunked body without end (limit 1 MiB); {mib(sent)} sent", status_of(sock)


# (name, attack, expected answer, whether an answer passes)
ATTACKS: list[tuple[str, Attack, str, Callable[[str], bool]]] = [
    ("endless header", endless_header, "431 or closed", lambda a: a in ("431", "closed")),
    ("endless headers x8", endless_headers_8, "431 or closed", lambda a: "open" not in a),
    ("long request line", long_request_line, "400 JSON", lambda a: a == "400"),
    ("long header", long_header, "431 JSON", lambda a: a == "431"),
    ("too many headers", many_headers, "431", lambda a: a == "431"),
    (
        "slowloris",
        trickle,
        f"closed within {HEADER_TIMEOUT_S:g} s + 1",
        lambda a: a.startswith("closed") and float(a.split()[2]) <= HEADER_TIMEOUT_S + 1,
    ),
    ("idle keep-alive", idle, "200, then closed", lambda a: a.startswith("200, then closed")),
    ("pipelined flood", pipelined_flood, "reading paused", lambda a: a == "reading paused"),
    ("declared body over the limit", declared_body, "413 JSON", lambda a: a == "413"),
    ("chunked body over the limit", chunked_body, "413 JSON", lambda a: a == "413"),
]
MAX_PAYLOAD = 1 << 20  # the router's --max-payload-size in these rows
ROUTER_ARGS = [
    "--max-payload-size",
    str(MAX_PAYLOAD),
    "--header-read-timeout-secs",
    str(HEADER_TIMEOUT_S),
]


def run_all(router: Server) -> list[LimitResult]:
    """Every attack on `router` (started with ROUTER_ARGS), one after the other."""
    results = []
    pid, port = router.proc.pid, router.port
    for name, attack, expected, ok in ATTACKS:
        before = rss_mib(pid) or math.nan  # nan: the router is gone
        began = time.monotonic()
        try:
            sent, answer = attack(port)
        except OSError as exc:
            sent, answer = "(the attack broke)", f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - began
        time.sleep(0.5)  # what the connection held is released
        results.append(
            LimitResult(
                name,
                sent,
                answer,
                expected,
                ok(answer),
                before,
                rss_mib(pid) or math.nan,
                serving(port),
                round(took, 2),
            )
        )
    return results

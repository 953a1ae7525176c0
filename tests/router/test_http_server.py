"""The router's HTTP server (router.http_server, granian), on raw sockets: what an HTTP/1.1
client may send (keep-alive, pipelining, chunked bodies, Expect, HTTP/1.0) and the limits a
gateway needs against what an attacker may send (long lines, endless heads, trickled bytes,
huge bodies), each answered or closed without the router's memory growing."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from router.http_server import port_is_free
from tests.procs import ROOT, TEST_ENV, Server
from tests.router.test_router import cluster

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
TIMEOUT_S = 2.0  # the routers' --header-read-timeout-secs here


@pytest.fixture(scope="module")
def routed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("http-server")
    extra = ("--max-payload-size", "4096", "--header-read-timeout-secs", str(TIMEOUT_S))
    with cluster(model_dir, logs, n=1, extra=extra) as (r, _):
        yield r


@contextlib.contextmanager
def connect(server: Server) -> Iterator[tuple[socket.socket, BinaryIO]]:
    where = urllib.parse.urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        yield sock, sock.makefile("rb")


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    lines = [f"POST {path} HTTP/{version}", "Host: router", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: router", *headers]) + "\r\n\r\n").encode()


def read_response(f: BinaryIO) -> tuple[int, dict[str, str], bytes]:
    """One response off the stream: status, lowercase headers, the (de-chunked) body."""
    status_line = f.readline()
    assert status_line, "the connection closed before an answer"
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline().rstrip(b"\r\n")) != b"":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, f.read(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while (size := int(f.readline().strip(), 16)) > 0:
            body += f.read(size)
            f.readline()
        f.readline()
        return status, headers, body
    return status, headers, f.read()


def closed(sock: socket.socket, f: BinaryIO, within_s: float = 5.0) -> bool:
    """Whether the router closed the connection (no more bytes will come)."""
    sock.settimeout(within_s)
    try:
        return f.read(1) == b""
    except ConnectionResetError:
        return True


def as_json(body: bytes) -> Any:
    return json.loads(body)


def rss_kib(server: Server) -> int:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_one_connection_serves_inference_and_management_in_turn(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode()))
        status, headers, body = read_response(f)
        assert status == 200 and as_json(body)["choices"][0]["message"]["content"]
        assert headers["content-type"].startswith("application/json") and "date" in headers
        sock.sendall(get("/health"))
        assert read_response(f)[0] == 200
        sock.sendall(post("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'))
        status, _, body = read_response(f)
        assert status == 200 and "text" in as_json(body)


def test_pipelined_requests_are_answered_in_order(routed: Server) -> None:
    with connect(routed) as (sock, f):
        first = {"text": "one", "sampling_params": {"max_new_tokens": 1}}
        second = {"text": "two two", "sampling_params": {"max_new_tokens": 3}}
        sock.sendall(
            post("/generate", json.dumps(first).encode())
            + get("/health")
            + post("/generate", json.dumps(second).encode())
        )
        one, health, two = (read_response(f) for _ in range(3))
        assert as_json(one[2])["meta_info"]["completion_tokens"] == 1
        assert health[:1] == (200,) and health[2] == b"OK"
        assert as_json(two[2])["meta_info"]["completion_tokens"] == 3


def test_streams_are_chunked_and_the_connection_stays_open(routed: Server) -> None:
    with connect(routed) as (sock, f):
        for _ in range(2):
            sock.sendall(
                post("/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode())
            )
            status, headers, body = read_response(f)
            assert status == 200 and headers["content-type"].startswith("text/event-stream")
            events = [ln[6:] for ln in body.decode().splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) >= 2


def test_chunked_request_bodies_and_expect_100_continue(routed: Server) -> None:
    body = json.dumps(CHAT).encode()
    with connect(routed) as (sock, f):
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        pieces = [body[:10], body[10:]]
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        sock.sendall(head.encode() + chunks)
        assert read_response(f)[0] == 200
    with connect(routed) as (sock, f):
        headers = post("/v1/chat/completions", body, "Expect: 100-continue")
        sock.sendall(headers[: -len(body)])  # the client waits for 100 Continue
        assert f.readline().startswith(b"HTTP/1.1 100")
        assert f.readline() == b"\r\n"
        sock.sendall(body)
        assert read_response(f)[0] == 200


def test_an_offer_to_upgrade_is_declined_and_the_request_answered(routed: Server) -> None:
    """curl --http2 on http:// offers h2c; the answer comes in HTTP/1.1, body read whole."""
    body = b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'
    offer = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQ")
    with connect(routed) as (sock, f):
        sock.sendall(post("/generate", body, *offer))
        status, _, answer = read_response(f)
        assert status == 200 and "text" in as_json(answer)


def test_http_1_0_is_answered_then_closed(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode(), version="1.0"))
        status, _, body = read_response(f)
        assert status == 200 and as_json(body)["choices"]
        assert closed(sock, f)


def test_a_body_over_the_limit_is_413_and_the_client_reads_it(routed: Server) -> None:
    big = b'{"text": "' + b"a" * 5000 + b'"}'
    with connect(routed) as (sock, f):  # asked first: answered before a byte of the body
        sock.sendall(post("/generate", big, "Expect: 100-continue")[: -len(big)])
        status, _, body = read_response(f)
        assert status == 413 and "--max-payload-size (4096 bytes)" in as_json(body)["message"]
        assert closed(sock, f)
    with connect(routed) as (sock, f):  # sent whole before reading: read and dropped, 413
        sock.sendall(post("/generate", big))
        status, _, body = read_response(f)
        assert status == 413 and as_json(body)["code"] == 413
    with connect(routed) as (sock, f):  # chunked: counted as it arrives
        head = "POST /generate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head.encode() + b"1000\r\n" + b"a" * 4096 + b"\r\n10\r\n" + b"b" * 16)
        status, _, body = read_response(f)
        assert status == 413 and as_json(body)["code"] == 413


def test_malformed_http_is_a_400_and_closed(routed: Server) -> None:
    """hyper refuses what is not HTTP before the router sees it (its 400 has no body)."""
    with connect(routed) as (sock, f):
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        assert read_response(f)[0] == 400
        assert closed(sock, f)


def test_a_long_request_line_or_header_is_a_json_error(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(get("/health?" + "q" * 9000))
        status, _, body = read_response(f)
        assert status == 400 and "request line longer than 8190" in as_json(body)["message"]
        assert closed(sock, f)
    with connect(routed) as (sock, f):
        sock.sendall(get("/health", "X-Big: " + "b" * 9000))
        status, _, body = read_response(f)
        assert status == 431 and "'x-big' longer than 8190" in as_json(body)["message"]
    with connect(routed) as (sock, f):  # many headers, each short: the head is bounded
        sock.sendall(get("/health", *(f"X-H{i}: {'v' * 4000}" for i in range(20))))
        assert read_response(f)[0] == 431
    with connect(routed) as (sock, f):
        sock.sendall(get("/health", *(f"X-H{i}: v" for i in range(120))))
        assert read_response(f)[0] == 431


def test_an_endless_head_is_cut_off_and_memory_stays_put(routed: Server) -> None:
    """The issue's attack: a request line, then one header that never ends (200 MiB were
    read to the end before). The head stops at 64 KiB with a 431 and a close."""
    before = rss_kib(routed)
    for _ in range(4):
        with connect(routed) as (sock, f):
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Endless: ")
            sent = 0
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                while sent < 64 * 1024 * 1024:
                    sock.sendall(b"a" * 65536)
                    sent += 65536
            assert sent < 8 * 1024 * 1024  # refused long before
            with contextlib.suppress(ConnectionResetError):
                status_line = f.readline()
                assert status_line == b"" or status_line.split()[1] == b"431"
    assert rss_kib(routed) - before < 16 * 1024


def test_a_head_trickled_a_byte_at_a_time_is_closed_at_the_timeout(routed: Server) -> None:
    """Slowloris: a byte every half second keeps no connection past the header timeout."""
    with connect(routed) as (sock, _):
        began = time.monotonic()
        sock.settimeout(0.5)
        gone = False
        for byte in get("/health", "X-Slow: " + "s" * 100)[:-2]:
            try:
                sock.sendall(bytes([byte]))
                if sock.recv(1) == b"":
                    gone = True
                    break
            except TimeoutError:
                continue  # nothing back yet: one more byte
            except (ConnectionResetError, BrokenPipeError):
                gone = True
                break
        assert gone and time.monotonic() - began < TIMEOUT_S + 2.0


def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(get("/health"))
        assert read_response(f)[0] == 200
        began = time.monotonic()
        assert closed(sock, f, within_s=TIMEOUT_S + 3.0)
        assert TIMEOUT_S - 0.5 < time.monotonic() - began < TIMEOUT_S + 3.0


def test_every_refusal_is_a_json_error(model_dir: Path, tmp_path: Path) -> None:
    bad = [
        ("/v1/chat/completions", b"{", 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/generate", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}', 404),
    ]
    with (
        cluster(model_dir, tmp_path, n=1, extra=("--api-key", "k")) as (r, _),
        connect(r) as (sock, f),
    ):
        for path, body, expected in bad:
            sock.sendall(post(path, body, "Authorization: Bearer k"))
            status, headers, payload = read_response(f)
            assert status == expected and headers["content-type"].startswith("application/json")
            assert as_json(payload)["code"] == expected
        sock.sendall(post("/generate", b'{"text": "hi"}'))  # no key
        status, _, payload = read_response(f)
        assert status == 401 and "API key" in as_json(payload)["message"]
        sock.sendall(get("/no-such-route", "Authorization: Bearer k"))
        status, _, payload = read_response(f)
        assert status == 404 and as_json(payload)["code"] == 404
        sock.sendall(post("/health", b"{}", "Authorization: Bearer k"))
        status, headers, payload = read_response(f)
        assert status == 405 and headers["allow"] == "GET" and as_json(payload)["code"] == 405
        sock.sendall(get("/health"))  # open without the key
        assert read_response(f)[0] == 200


def test_requests_split_anywhere_across_segments(routed: Server) -> None:
    """However TCP cuts a request (inside its request line, a header, the body), the answer
    is the same."""
    requests = [
        (get("/health"), 200),
        (get("/v1/models"), 200),
        (post("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'), 200),
        (post("/v1/chat/completions", b'{"messages": []}'), 400),
    ]
    for data, status in requests:
        for cut in range(1, len(data), 23):
            with connect(routed) as (sock, f):
                sock.sendall(data[:cut])
                time.sleep(0.002)  # two segments, not one
                sock.sendall(data[cut:])
                got, _, body = read_response(f)
                assert got == status, (data[:cut], body)
                sock.sendall(data)  # and the connection serves the next one whole
                assert read_response(f)[0] == status


def test_a_second_router_on_a_taken_port_says_so(routed: Server, tmp_path: Path) -> None:
    """granian shares ports (SO_REUSEPORT): without the check a second router would take
    half of the first one's connections without a word."""
    done = subprocess.run(
        [sys.executable, "-m", "router", "--worker-urls", "http://127.0.0.1:9"]
        + ["--policy", "round_robin", "--port", str(routed.port)],
        cwd=ROOT,
        env={**os.environ, **TEST_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "already in use" in done.stderr


def test_a_port_left_in_time_wait_by_a_killed_router_is_free() -> None:
    """A router restarted right after a crash finds its port free: the connections the dead
    one closed linger in TIME_WAIT on it, and only a listener makes a port taken."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its end waits in TIME_WAIT
    time.sleep(0.05)
    client.close()
    assert not port_is_free("127.0.0.1", port)  # still listening
    listener.close()
    assert port_is_free("127.0.0.1", port)

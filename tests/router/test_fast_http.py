"""The inference routes' httptools server (router.fast_http), on raw sockets: what an HTTP/1.1
client may send (keep-alive, pipelining, chunked bodies, Expect, HTTP/1.0) and the hand-over
of a connection to aiohttp's server for every other route."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from tests.procs import Server
from tests.router.test_router import cluster

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def routed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    logs = tmp_path_factory.mktemp("fast-http")
    with cluster(model_dir, logs, n=1, extra=("--max-payload-size", "4096")) as (r, _):
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


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: router\r\n\r\n".encode()


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


def closed(sock: socket.socket, f: BinaryIO) -> bool:
    """Whether the router closed the connection (no more bytes will come)."""
    sock.settimeout(5)
    return f.read(1) == b""


def as_json(body: bytes) -> Any:
    return json.loads(body)


def test_one_connection_serves_inference_and_management_in_turn(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode()))
        status, headers, body = read_response(f)
        assert status == 200 and as_json(body)["choices"][0]["message"]["content"]
        assert headers["content-type"].startswith("application/json") and "date" in headers
        sock.sendall(get("/health"))  # hands the connection to aiohttp's server
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
            + post("/generate", json.dumps(second).encode())
        )
        answers = [as_json(read_response(f)[2]) for _ in range(2)]
        assert [a["meta_info"]["completion_tokens"] for a in answers] == [1, 3]


def test_a_management_request_pipelined_behind_inference_is_refused_clearly(
    routed: Server,
) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(post("/v1/chat/completions", json.dumps(CHAT).encode()) + get("/health"))
        assert read_response(f)[0] == 200
        status, _, body = read_response(f)
        assert status == 400 and "pipelined" in as_json(body)["message"]
        assert closed(sock, f)


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
        status, headers, _ = read_response(f)
        assert status == 200 and headers.get("connection") == "close"
        assert closed(sock, f)


def test_a_body_over_the_limit_is_413_before_it_is_read(routed: Server) -> None:
    with connect(routed) as (sock, f):
        big = b'{"text": "' + b"a" * 5000 + b'"}'
        sock.sendall(post("/generate", big)[: -len(big)])  # the headers announce 5,012 bytes
        status, headers, body = read_response(f)
        assert status == 413 and "--max-payload-size (4096 bytes)" in as_json(body)["message"]
        assert headers.get("connection") == "close" and closed(sock, f)
    with connect(routed) as (sock, f):  # chunked: counted as it arrives
        head = "POST /generate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head.encode() + b"1000\r\n" + b"a" * 4096 + b"\r\n10\r\n" + b"b" * 16)
        assert read_response(f)[0] == 413


def test_malformed_http_is_a_400_json_error(routed: Server) -> None:
    with connect(routed) as (sock, f):
        sock.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        status, _, body = read_response(f)
        assert status == 400 and "malformed HTTP request" in as_json(body)["message"]
        assert closed(sock, f)


def test_the_fast_path_and_aiohttp_give_the_same_errors(model_dir: Path, tmp_path: Path) -> None:
    bad = [
        ("/v1/chat/completions", b"{", 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/generate", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}', 404),
    ]
    answers: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    for server in ("fast", "aiohttp"):
        extra = ("--http-server", server, "--api-key", "k")
        (tmp_path / server).mkdir()
        with cluster(model_dir, tmp_path / server, n=1, extra=extra) as (r, _):
            got = []
            with connect(r) as (sock, f):
                for path, body, _status in bad:
                    sock.sendall(post(path, body, "Authorization: Bearer k"))
                    status, headers, payload = read_response(f)
                    got.append((status, headers["content-type"], as_json(payload)))
                sock.sendall(post("/generate", b'{"text": "hi"}'))  # no key
                status, headers, payload = read_response(f)
                got.append((status, headers["content-type"], as_json(payload)))
            answers[server] = got
    assert [s for s, _, _ in answers["fast"]] == [s for _, _, s in bad] + [401]
    assert answers["fast"] == answers["aiohttp"]


def test_requests_split_anywhere_across_segments(routed: Server) -> None:
    """However TCP cuts a request (inside its request line, a header, the body), the answer
    is the same: for an inference route, and for a route handed to aiohttp mid-headers."""
    requests = [
        (get("/health"), 200),
        (get("/v1/models"), 200),
        (post("/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": 1}}'), 200),
        (post("/v1/chat/completions", b'{"messages": []}'), 400),
    ]
    for data, status in requests:
        for cut in range(1, len(data), 7):
            with connect(routed) as (sock, f):
                sock.sendall(data[:cut])
                time.sleep(0.002)  # two segments, not one
                sock.sendall(data[cut:])
                got, _, body = read_response(f)
                assert got == status, (data[:cut], body)
                sock.sendall(data)  # and the connection serves the next one whole
                assert read_response(f)[0] == status

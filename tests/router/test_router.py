"""The router in front of real CPU workers, over real HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.http_client import call, stream
from tests.procs import Server, free_port, running

SYSTEM = "You are a meticulous assistant for a logistics company. " + (
    "Always answer with the shipment policy in mind, cite the section, and be brief. " * 12
)


def sim_worker(model_dir: Path, log_dir: Path, *extra: str):
    return running(
        "connector.worker",
        ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", "0", *extra],
        log_dir,
    )


def router(urls: list[str], log_dir: Path, *extra: str, policy: str = "prompt-tree"):
    return running(
        "router",
        ["--policy", policy, "--worker-urls", *urls, "--health-check-interval-secs", "0.5", *extra],
        log_dir,
    )


@contextlib.contextmanager
def cluster(
    model_dir: Path, log_dir: Path, n: int = 2, worker_args: tuple[str, ...] = (), **router_kw
) -> Iterator[tuple[Server, list[Server]]]:
    with contextlib.ExitStack() as stack:
        workers = [
            stack.enter_context(sim_worker(model_dir, log_dir, *worker_args)) for _ in range(n)
        ]
        extra = router_kw.pop("extra", ())
        r = stack.enter_context(router([w.url for w in workers], log_dir, *extra, **router_kw))
        yield r, workers


def served_by(router_server: Server) -> dict[str, int]:
    info = call(router_server.url + "/get_server_info")[1]
    return {w["url"]: w["processed"] for w in info["workers"]}


def chat(url: str, messages: list[dict], max_tokens: int = 8, headers: dict | None = None):
    body = {"messages": messages, "max_tokens": max_tokens}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_openai_client_multi_turn_sticks_to_the_history(model_dir: Path, tmp_path: Path) -> None:
    with cluster(model_dir, tmp_path, n=3) as (r, _workers):
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="none")
        messages: list[Any] = [{"role": "system", "content": SYSTEM}]
        cached: list[int] = []
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn}: where is box {turn}?"})
            reply = client.chat.completions.create(
                model="default", messages=messages, max_tokens=12
            )
            assert reply.usage and reply.usage.prompt_tokens_details
            cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert cached[0] == 0
        assert all(b > a for a, b in itertools.pairwise(cached)), cached
        assert sorted(served_by(r).values()) == [0, 0, 4]  # every turn on the history's holder


def session_ids_on_different_workers(urls: list[str]) -> tuple[str, str]:
    """Two session ids the session policy sends to different workers (its own hashing)."""

    def home(sid: str) -> str:
        return max(
            urls, key=lambda u: hashlib.blake2b(f"{sid}|{u}".encode(), digest_size=8).digest()
        )

    first = "alice"
    second = next(f"user-{i}" for i in range(1000) if home(f"user-{i}") != home(first))
    return first, second


@pytest.mark.parametrize(("policy", "shares"), [("prompt_tree", True), ("session", False)])
def test_sessions_share_a_system_prompt_across_instances(
    model_dir: Path, tmp_path: Path, policy: str, shares: bool
) -> None:
    with cluster(model_dir, tmp_path, policy=policy) as (r, workers):
        a, b = session_ids_on_different_workers([w.url for w in workers])
        first = chat(
            r.url,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Track parcel 1."}],
            headers={"X-Session-Id": a},
        )
        second = chat(
            r.url,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Track parcel 2."}],
            headers={"X-Session-Id": b},
        )
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (reused > 200) if shares else (reused == 0), reused


@pytest.mark.parametrize(
    ("policy", "abs_threshold", "spreads"),
    [
        ("prompt_tree", "2", True),  # sglang-router's load thresholds
        ("prompt_tree", "100000", True),  # the expected-TTFT guard alone
        ("cache_aware", "100000", False),  # sglang-router's rule piles on the holder
    ],
)
def test_overload_guard_moves_traffic(
    model_dir: Path, tmp_path: Path, policy: str, abs_threshold: str, spreads: bool
) -> None:
    """Sixteen long requests share one prefix: with the guard they do not all pile on its
    holder (once about nine run there, waiting costs more than recomputing the prefix)."""
    extra = ("--balance-abs-threshold", abs_threshold, "--balance-rel-threshold", "1.5")
    slow = ("--time-scale", "1")
    with cluster(model_dir, tmp_path, worker_args=slow, extra=extra, policy=policy) as (r, _):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm"}]
        chat(r.url, messages, max_tokens=2)  # the prefix now lives on one worker
        counts = served_by(r)
        holder = max(counts, key=lambda url: counts[url])
        threads = [threading.Thread(target=chat, args=(r.url, messages, 150)) for _ in range(16)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        served = served_by(r)
        others = sum(n for url, n in served.items() if url != holder)
        if spreads:
            assert others >= 2, served
        else:
            assert others == 0, served


@pytest.mark.parametrize(
    "policy",
    [
        "round_robin",
        "random",
        "least_load",
        "power_of_two",
        "session",
        "cache_aware",
        "prompt_tree",
        "cost",
    ],
)
def test_every_policy_routes(model_dir: Path, tmp_path: Path, policy: str) -> None:
    with cluster(model_dir, tmp_path, policy=policy) as (r, _workers):
        for i in range(4):
            status, body = call(
                r.url + "/generate",
                {"text": f"{SYSTEM} item {i}", "sampling_params": {"max_new_tokens": 3}},
            )
            assert status == 200 and body["meta_info"]["completion_tokens"] == 3
        assert sum(served_by(r).values()) == 4
        info = call(r.url + "/get_server_info")[1]
        assert info["policy"] == policy


def test_tree_entries_expire_after_the_ttl(model_dir: Path, tmp_path: Path) -> None:
    with cluster(model_dir, tmp_path, n=1, extra=("--tree-ttl-secs", "0.5")) as (r, _):
        chat(r.url, [{"role": "user", "content": SYSTEM}])
        assert call(r.url + "/get_server_info")[1]["tree_pages"]["colocated"] > 0
        time.sleep(1.5)
        assert call(r.url + "/get_server_info")[1]["tree_pages"]["colocated"] == 0


def test_workers_added_and_removed_at_run_time(model_dir: Path, tmp_path: Path) -> None:
    with (
        sim_worker(model_dir, tmp_path) as w1,
        sim_worker(model_dir, tmp_path) as w2,
        router([w1.url], tmp_path) as r,
    ):
        status, body = call(r.url + "/workers", {"url": w2.url})
        assert status == 200 and body["healthy"]
        assert call(r.url + "/workers", {"url": w2.url})[0] == 409
        assert call(r.url + "/workers", {"url": "not a url"})[0] == 400
        assert len(call(r.url + "/workers")[1]["workers"]) == 2
        encoded = urllib.parse.quote(w1.url, safe="")
        assert call(r.url + f"/workers/{encoded}", method="DELETE")[0] == 200
        assert call(r.url + f"/workers/{encoded}", method="DELETE")[0] == 404
        for i in range(3):
            assert chat(r.url, [{"role": "user", "content": f"hi {i}"}])["usage"]
        assert served_by(r) == {w2.url: 3}


def test_streaming_is_the_workers_stream(model_dir: Path, tmp_path: Path) -> None:
    with cluster(model_dir, tmp_path, n=1) as (r, (worker,)):
        body = {
            "messages": [{"role": "user", "content": "Stream please."}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        via_router = stream(r.url + "/v1/chat/completions", body)
        assert call(worker.url + "/flush_cache", method="POST", raw=b"")[0] == 200
        direct = stream(worker.url + "/v1/chat/completions", body)

        def strip(events: list) -> list:
            return [
                e if e == "[DONE]" else {k: v for k, v in e.items() if k not in {"id", "created"}}
                for e in events
            ]

        assert strip(via_router) == strip(direct)
        # the router's time to first token: this streamed request's, at most its duration
        metrics = call(r.url + "/metrics")[1]
        route = '{route="/v1/chat/completions"}'
        ttft = value(metrics, f"memserve_router_time_to_first_token_seconds_sum{route}")
        whole = value(metrics, f"sgl_router_request_duration_seconds_sum{route}")
        assert 0 < ttft <= whole
        assert value(metrics, f"memserve_router_time_to_first_token_seconds_count{route}") == 1


def value(metrics: str, series: str) -> float:
    """One series' value in a Prometheus text page."""
    line = next(x for x in metrics.splitlines() if x.startswith(series + " "))
    return float(line.split()[-1])


def test_stream_bytes_pass_through_unchanged(tmp_path: Path) -> None:
    """Against a scripted upstream that splits events at odd byte boundaries."""
    from aiohttp import web

    chunks = [
        b'data: {"text": "caf',
        '\u00e9 \u2603"}\n'.encode(),
        b'\ndata: {"te',
        b'xt": "x"}\n\n',
        b"data: [DONE]\n\n",
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    port = free_port()
    app = web.Application()
    app.router.add_post("/generate", handler)
    app.router.add_get("/health", health)
    import asyncio

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with router([f"http://127.0.0.1:{port}"], tmp_path, policy="round_robin") as r:
            req = urllib.request.Request(
                r.url + "/generate",
                json.dumps({"text": "x", "stream": True}).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.read() == b"".join(chunks)
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.parametrize(
    ("path", "payload", "status", "needle"),
    [
        ("/v1/chat/completions", b"{oops", 400, "not valid JSON"),
        ("/v1/chat/completions", b"[]", 400, "JSON object"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "non-empty"),
        ("/v1/chat/completions", b'{"messages": "hi"}', 400, "non-empty"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "content"),
        (
            "/v1/chat/completions",
            b'{"model": "gpt-9", "messages": [{"role": "user"}]}',
            404,
            "not found",
        ),
        ("/generate", b'{"sampling_params": {}}', 400, "exactly one"),
        ("/generate", b'{"input_ids": "abc"}', 400, "input_ids"),
        ("/v1/completions", b'{"prompt": 3}', 400, "prompt"),
        ("/generate", b'{"text": "' + b"x" * 5000 + b'"}', 413, "max-payload-size"),
    ],
)
def test_bad_input_is_refused_without_touching_a_worker(
    model_dir: Path, tmp_path: Path, path: str, payload: bytes, status: int, needle: str
) -> None:
    with cluster(model_dir, tmp_path, n=1, extra=("--max-payload-size", "4096")) as (r, (w,)):
        got, body = call(r.url + path, raw=payload)
        assert got == status, body
        assert body["code"] == status and needle in body["message"]
        assert served_by(r) == {w.url: 0}
        metrics = call(w.url + "/metrics")[1]
        assert "sglang:num_requests_total{model_name" not in metrics or " 0.0" in next(
            ln for ln in metrics.splitlines() if ln.startswith("sglang:num_requests_total")
        )


def test_worker_dying_mid_stream_ends_the_stream_with_an_error(
    model_dir: Path, tmp_path: Path
) -> None:
    with (
        sim_worker(model_dir, tmp_path, "--time-scale", "1") as w,
        router([w.url], tmp_path, "--disable-retries") as r,
    ):
        req = urllib.request.Request(
            r.url + "/generate",
            json.dumps(
                {"text": "long story", "stream": True, "sampling_params": {"max_new_tokens": 5000}}
            ).encode(),
            {"Content-Type": "application/json"},
        )
        started = time.monotonic()
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.readline().startswith(b"data: ")
            os.kill(w.proc.pid, signal.SIGKILL)
            rest = resp.read().decode()
        assert time.monotonic() - started < 20
        events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 502 and "mid-stream" in error["message"]


def test_api_key_protects_routes(model_dir: Path, tmp_path: Path) -> None:
    with cluster(model_dir, tmp_path, n=1, extra=("--api-key", "s3cret")) as (r, _):
        assert call(r.url + "/health")[0] == 200
        status, body = call(r.url + "/generate", {"text": "hi"})
        assert status == 401 and body["code"] == 401
        # /metrics names every worker: with a key, this port's copy needs it too
        assert call(r.url + "/metrics")[0] == 401
        for path in ("/workers", "/metrics"):
            headers = {"Authorization": "Bearer s3cret"}
            req = urllib.request.Request(r.url + path, headers=headers)
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert resp.status == 200


def test_full_queue_answers_429_with_retry_after(model_dir: Path, tmp_path: Path) -> None:
    extra = ("--max-concurrent-requests", "1", "--queue-size", "0")
    with cluster(model_dir, tmp_path, n=1, worker_args=("--time-scale", "1"), extra=extra) as (
        r,
        _,
    ):
        slow = threading.Thread(
            target=call,
            args=(
                r.url + "/generate",
                {"text": "slow", "sampling_params": {"max_new_tokens": 200}},
            ),
        )
        slow.start()
        time.sleep(0.5)
        req = urllib.request.Request(
            r.url + "/generate",
            json.dumps({"text": "fast"}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 429 and err.value.headers["Retry-After"] == "1"
        slow.join()


def test_dead_worker_is_retried_around_and_marked(model_dir: Path, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with (
        sim_worker(model_dir, tmp_path) as w,
        router([dead, w.url], tmp_path, policy="round_robin") as r,
    ):
        for i in range(4):
            status, body = call(r.url + "/generate", {"text": f"hello {i}"})
            assert status == 200, body
        workers = {x["url"]: x for x in call(r.url + "/workers")[1]["workers"]}
        assert workers[dead]["healthy"] is False and workers[w.url]["processed"] == 4

"""The router in PD mode: sglang-router's wire protocol, real hf workers, trees per mode."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from tests.http_client import call, stream
from tests.procs import free_port, running

SYSTEM = "You answer in one short sentence. " * 6


def hf(model_dir: Path, *extra: str) -> list[str]:
    return ["--backend", "hf", "--model-path", str(model_dir), "--threads", "1", *extra]


@contextlib.contextmanager
def pd_cluster(model_dir: Path, log_dir: Path, caching: str = "caching-3", policy="prompt-tree"):
    boot = free_port()
    common = ["--pd-caching", caching, "--disaggregation-timeout-secs", "20"]
    prefill = hf(model_dir, "--disaggregation-mode", "prefill", "--instance-id", "21")
    prefill += ["--disaggregation-bootstrap-port", str(boot), *common]
    decode = hf(model_dir, "--disaggregation-mode", "decode", "--instance-id", "22", *common)
    with (
        running("connector.worker", prefill, log_dir) as p,
        running("connector.worker", decode, log_dir) as d,
        running(
            "router",
            ["--policy", policy, "--pd-disaggregation", "--prefill", p.url, str(boot)]
            + ["--decode", d.url, "--pd-caching", caching, "--health-check-interval-secs", "0.5"],
            log_dir,
        ) as r,
    ):
        yield r, p, d


@pytest.fixture(scope="module")
def colocated(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running("connector.worker", hf(model_dir), tmp_path_factory.mktemp("colo")) as w:
        yield w


def test_multi_turn_chat_through_pd_equals_colocated_and_reuses_the_history(
    model_dir: Path, tmp_path: Path, colocated
) -> None:
    with pd_cluster(model_dir, tmp_path) as (r, p, d):
        via = openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0)
        ref = openai.OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0)
        history: list[Any] = [{"role": "system", "content": SYSTEM}]
        cached = []
        for turn in range(3):
            history.append({"role": "user", "content": f"Question {turn}: name a colour."})
            kwargs: dict[str, Any] = {"model": "default", "max_tokens": 6, "temperature": 0}
            got = via.chat.completions.create(messages=history, **kwargs)
            want = ref.chat.completions.create(messages=history, **kwargs)
            assert got.choices[0].message.content == want.choices[0].message.content
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
            history.append({"role": "assistant", "content": got.choices[0].message.content})
            time.sleep(0.5)  # the decode's write-back to the prefill runs after its answer
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]

        info = call(r.url + "/get_server_info")[1]
        assert info["tree_pages"]["prefill"] > 0 and info["tree_pages"]["decode"] > 0
        metrics = call(r.url + "/metrics")[1]
        assert "sgl_router_pd_requests_total 3.0" in metrics

        # streamed answers come from the decode worker, through the router
        body = {"messages": history, "max_tokens": 4, "temperature": 0, "stream": True}
        events = stream(r.url + "/v1/chat/completions", body)
        assert events[-1] == "[DONE]"
        text = "".join(
            e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices")
        )
        direct = call(colocated.url + "/v1/chat/completions", {**body, "stream": False})[1]
        assert text == direct["choices"][0]["message"]["content"]
        # one time to first token: the streamed request's (the unstreamed ones have none),
        # taken when the decode's first token reached the client, not the prefill's answer
        ttft = "memserve_router_time_to_first_token_seconds"
        metrics = call(r.url + "/metrics")[1]
        assert f'{ttft}_count{{route="/v1/chat/completions"}} 1.0' in metrics
        for worker in (p, d):  # every block is cache; nothing a request held is left over
            deadline = time.monotonic() + 10  # (a request's blocks are freed once it ends)
            while True:
                pool = call(worker.url + "/get_server_info")[1]["mempool"]
                used = sum(t["used"] for t in pool["tiers"].values())
                if used * 16 == pool["cached_tokens"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert used * 16 == pool["cached_tokens"], pool


class Scripted:
    """Two scripted SGLang servers recording what the router sends them."""

    def __init__(self, prefill_status: int = 200, written_back: int | None = None) -> None:
        self.bodies: dict[str, list[dict]] = {"prefill": [], "decode": []}
        self.prefill_status = prefill_status
        self.written_back = written_back  # the prefill's report, as our workers make it
        self.loop = asyncio.new_event_loop()
        self.ports = {"prefill": free_port(), "decode": free_port()}

    def app(self, side: str) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.bodies[side].append(body)
            if side == "prefill":
                if self.prefill_status != 200:
                    return web.json_response({"message": "prefill broke"}, status=500)
                meta = {"cached_tokens": 0, "input_token_logprobs": [[-1.0, 5, None]]}
                if self.written_back is not None:
                    meta["written_back_tokens"] = self.written_back
                return web.json_response({"text": "", "meta_info": meta})
            if self.prefill_status != 200:
                await asyncio.sleep(30)  # a decode waiting for KV that never comes
            meta = {"cached_tokens": 0, "input_token_logprobs": [[-2.0, 6, None]]}
            return web.json_response({"text": "ok", "output_ids": [1], "meta_info": meta})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        return app

    def __enter__(self) -> Scripted:
        async def start() -> None:
            for side, port in self.ports.items():
                runner = web.AppRunner(self.app(side), shutdown_timeout=0.1)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                self.runners.append(runner)

        self.runners: list[web.AppRunner] = []
        self.loop.run_until_complete(start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:  # handlers still waiting are cancelled, not left pending
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def url(self, side: str) -> str:
        return f"http://127.0.0.1:{self.ports[side]}"


def scripted_router(s: Scripted, log_dir: Path, *extra: str):
    args = ["--policy", "round_robin", "--prefill", s.url("prefill"), "8998"]
    args += ["--decode", s.url("decode"), "--health-check-interval-secs", "0.5", *extra]
    return running("router", args, log_dir)


def test_bootstrap_fields_are_injected_as_sglang_router_does(tmp_path: Path) -> None:
    with Scripted() as s, scripted_router(s, tmp_path) as r:
        status, body = call(r.url + "/generate", {"text": "hi", "return_logprob": True})
        assert status == 200
        (pre,), (dec,) = s.bodies["prefill"], s.bodies["decode"]
        assert pre == dec  # the same body to both
        assert pre["bootstrap_host"] == "127.0.0.1" and pre["bootstrap_port"] == 8998
        assert isinstance(pre["bootstrap_room"], int) and 0 <= pre["bootstrap_room"] < 2**63
        assert pre["text"] == "hi" and pre["return_logprob"] is True
        # with logprobs, the prefill's input logprobs come first
        assert body["meta_info"]["input_token_logprobs"] == [[-1.0, 5, None], [-2.0, 6, None]]

        status, _ = call(r.url + "/generate", {"text": ["a", "b", "c"]})
        batch = s.bodies["decode"][-1]
        assert status == 200 and len(batch["bootstrap_room"]) == 3
        assert batch["bootstrap_host"] == ["127.0.0.1"] * 3
        assert len(set(batch["bootstrap_room"])) == 3


def write_back_marks(s: Scripted, router_url: str, requests: int) -> list[bool]:
    """Per request sent, whether the router told the decode not to write back."""
    for i in range(requests):
        assert call(router_url + "/generate", {"text": f"question {i}"})[0] == 200
    return [(b.get("memserve") or {}).get("write_back") is False for b in s.bodies["decode"]]


def test_write_back_is_skipped_while_the_prefill_reuses_none_of_it(tmp_path: Path) -> None:
    """PD-Caching-3 (the default): after 32 write-backs to a prefill that reports reusing no
    written-back token, the router tells the decode not to write back, but for one request in
    8 (which keeps measuring); a real SGLang prefill reports nothing and always gets them."""
    with Scripted(written_back=0) as s, scripted_router(s, tmp_path) as r:
        skipped = write_back_marks(s, r.url, 48)
        assert not any(skipped[:32])
        assert skipped[32:] == [True] * 7 + [False] + [True] * 7 + [False]
        assert s.bodies["prefill"][-2]["memserve"] == {"write_back": False}  # ignored there
        metrics = call(r.url + "/metrics")[1]
        name = "memserve_router_pd_write_backs_total"
        for decision, count in (("asked", 32), ("explored", 2), ("skipped", 14)):
            assert f'{name}{{decision="{decision}"}} {count}.0' in metrics
    with Scripted() as s, scripted_router(s, tmp_path) as r:
        assert not any(write_back_marks(s, r.url, 40))
    with (
        Scripted(written_back=0) as s,
        scripted_router(s, tmp_path, "--write-back", "always") as r,
    ):
        assert not any(write_back_marks(s, r.url, 40))


def test_a_failing_prefill_ends_the_request_at_once(tmp_path: Path) -> None:
    with Scripted(prefill_status=500) as s, scripted_router(s, tmp_path, "--disable-retries") as r:
        started = time.monotonic()
        status, body = call(r.url + "/generate", {"text": "hi"})
        assert status == 502 and "prefill broke" in body["message"]
        assert time.monotonic() - started < 10  # not the decode's 30 s wait

        status, body = call(r.url + "/generate", {"text": "hi", "stream": True})
        assert status == 502 and "prefill broke" in body["message"]


@pytest.mark.parametrize(
    "args",
    [
        ["--prefill", "http://127.0.0.1:1"],  # no decode
        ["--decode", "http://127.0.0.1:1"],  # no prefill
        ["--prefill", "http://127.0.0.1:1", "x", "--decode", "http://127.0.0.1:2"],
        ["--pd-caching", "caching-9", "--prefill", "http://127.0.0.1:1", "--decode", "u:2"],
    ],
)
def test_pd_misconfiguration_exits_with_a_message(args: list[str], tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "router", "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip()

"""Prefill/decode disaggregation between real sim workers: stand-in KV bytes, modelled time.

Each request goes to a prefill and a decode sim worker at once with SGLang's bootstrap fields,
as a router sends it; the stand-in KV pages (stamped with their page hashes, checked by the
decode before use) move through MemPool transfer agents over loopback TCP, and the time the
real 2 MiB pages would take on the modelled interconnect is slept by the sender. Faults
(MemServe 4.4): either side killed mid-request, Redis membership down at start or later.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RedisServer
from tests.http_client import call, metric, stream
from tests.procs import ROOT, Server, free_port, running

PAGE = 16


def sim_args(model_dir: Path, *extra: str, time_scale: str = "0") -> list[str]:
    return ["--backend", "sim", "--model-path", str(model_dir), "--time-scale", time_scale, *extra]


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


@contextlib.contextmanager
def pd_pair(
    model_dir: Path,
    log_dir: Path,
    caching: str = "caching-3",
    *extra: str,
    timeout: str = "20",
    time_scale: str = "0",
) -> Iterator[tuple[Server, Server, int]]:
    """A 1P1D pair of sim workers (instance ids chosen by the workers)."""
    boot = free_port()
    common = ["--pd-caching", caching, "--disaggregation-timeout-secs", timeout, *extra]
    prefill = sim_args(
        model_dir,
        "--disaggregation-mode",
        "prefill",
        "--disaggregation-bootstrap-port",
        str(boot),
        *common,
        time_scale=time_scale,
    )
    decode = sim_args(model_dir, "--disaggregation-mode", "decode", *common, time_scale=time_scale)
    with (
        running("connector.worker", prefill, log_dir) as p,
        running("connector.worker", decode, log_dir) as d,
    ):
        yield p, d, boot


def with_room(body: dict[str, Any], boot: int) -> dict[str, Any]:
    """The request as a router sends it to both sides: SGLang's bootstrap fields added."""
    room = random.randrange(2**63)
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}


def both(p: Server, d: Server, path: str, body: dict[str, Any], decode_stream: bool = False):
    """The same body to prefill and decode concurrently; both answers, (status, body) each."""

    def to_decode() -> tuple[int, Any]:
        if not decode_stream:
            return call(d.url + path, body)
        events = stream(d.url + path, {**body, "stream": True})
        return 200, events

    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(call, p.url + path, body)
        dec = pool.submit(to_decode)
        return pre.result(), dec.result()


def pd_generate(p: Server, d: Server, boot: int, ids: list[int], max_new: int = 8):
    body = with_room({"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}, boot)
    (ps, pb), (ds, db) = both(p, d, "/generate", body)
    assert ps == 200, pb
    assert ds == 200, db
    return pb, db


def info(worker: Server) -> dict[str, Any]:
    status, body = call(worker.url + "/get_server_info")
    assert status == 200, body
    return body


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def writes_back(prompt: int, out: int) -> int:
    """1 if a PD-Caching-3 decode has pages to write back: its KV crossed a page boundary
    after the whole prompt pages that arrived (already cached at the prefill)."""
    return int((prompt + out - 1) // PAGE > prompt // PAGE)


def written_back(decode: Server, count: int) -> None:
    """The write-back runs after the decode answered: wait for it like a next turn would."""
    wait_for(
        f"write-back #{count}",
        lambda: info(decode)["disaggregation"]["written_back"] >= count,
    )


def used_pages(worker: Server) -> tuple[int, int]:
    pool = info(worker)["mempool"]
    return sum(t["used"] for t in pool["tiers"].values()), pool["cached_tokens"] // PAGE


def no_leak(worker: Server) -> None:
    """Every allocated block is indexed cache: nothing a request held is left over."""
    used, cached = used_pages(worker)
    assert used == cached, (used, cached)


@pytest.fixture(scope="module")
def colocated(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running(
        "connector.worker", sim_args(model_dir), tmp_path_factory.mktemp("colocated")
    ) as server:
        yield server


def colocated_generate(worker: Server, ids: list[int], max_new: int = 8) -> list[int]:
    status, body = call(
        worker.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}
    )
    assert status == 200, body
    return body["output_ids"]


def chat(worker: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    status, body = call(
        worker.url + "/v1/chat/completions", {"messages": messages, "max_tokens": 9}
    )
    assert status == 200, body
    return body


# prefill's cached_tokens on turn 2, as a function of turn 1's prompt and output lengths
EXPECTED_TURN2_CACHED = {
    "basic": lambda prompt, out: 0,
    "caching-1": lambda prompt, out: prompt // PAGE * PAGE,
    "caching-2": lambda prompt, out: prompt // PAGE * PAGE,
    "caching-3": lambda prompt, out: (prompt + out - 1) // PAGE * PAGE,
}


@pytest.mark.parametrize("caching", ["basic", "caching-1", "caching-2", "caching-3"])
def test_sim_pd_multi_turn_equals_colocated_in_every_caching_mode(
    model_dir: Path, tmp_path: Path, colocated: Server, caching: str
) -> None:
    with pd_pair(model_dir, tmp_path, caching) as (p, d, boot):
        # /generate, two turns
        turn1 = prompt_ids(1, 300)
        pre1, dec1 = pd_generate(p, d, boot, turn1)
        out1 = dec1["output_ids"]
        assert out1 == colocated_generate(colocated, turn1)
        assert pre1["meta_info"]["cached_tokens"] == 0 == dec1["meta_info"]["cached_tokens"]
        backs = writes_back(len(turn1), len(out1))
        if caching == "caching-3":
            written_back(d, backs)
        turn2 = turn1 + out1 + prompt_ids(2, 40)
        pre2, dec2 = pd_generate(p, d, boot, turn2)
        assert dec2["output_ids"] == colocated_generate(colocated, turn2)
        expected = EXPECTED_TURN2_CACHED[caching](len(turn1), len(out1))
        assert pre2["meta_info"]["cached_tokens"] == expected
        assert dec2["meta_info"]["cached_tokens"] == expected  # the client sees the skip
        # Of those, the pages the decode wrote back (the prefill cached its own prompt).
        back = expected - len(turn1) // PAGE * PAGE if caching == "caching-3" else 0
        assert pre2["meta_info"]["written_back_tokens"] == back > 0 or caching != "caching-3"
        assert dec2["meta_info"]["written_back_tokens"] == back
        backs += writes_back(len(turn2), len(dec2["output_ids"]))

        # chat, two turns; the decode's answer streamed as a router would pass it through
        history = [{"role": "user", "content": f"Tell me about {caching} caching. " * 20}]
        ref1 = chat(colocated, history)
        (ps, pc), (ds, events) = both(
            p,
            d,
            "/v1/chat/completions",
            with_room({"messages": history, "max_tokens": 9}, boot),
            True,
        )
        assert ps == 200 and ds == 200, (pc, events)
        assert events[-1] == "[DONE]"
        content = "".join(
            e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]
        )
        assert content == ref1["choices"][0]["message"]["content"]
        prompt1, out1 = pc["usage"]["prompt_tokens"], ref1["usage"]["completion_tokens"]
        backs += writes_back(prompt1, out1)
        if caching == "caching-3":
            written_back(d, backs)
        history += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": "And then?"},
        ]
        ref2 = chat(colocated, history)
        (ps, pc2), (ds, dc2) = both(
            p, d, "/v1/chat/completions", with_room({"messages": history, "max_tokens": 9}, boot)
        )
        assert ps == 200 and ds == 200, (pc2, dc2)
        assert dc2["choices"][0]["message"] == ref2["choices"][0]["message"]
        cached = pc2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert dc2["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        if caching == "basic":
            assert cached == 0
        elif caching == "caching-3":  # the colocated worker cached turn 1 as a whole, too
            assert cached == ref2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= prompt1 // PAGE * PAGE
        else:
            assert cached == prompt1 // PAGE * PAGE

        pinfo, dinfo = info(p), info(d)
        assert pinfo["disaggregation"]["transport"] == "tcp"  # auto: no RDMA device here
        assert pinfo["disaggregation"]["sent"] == 4 and dinfo["disaggregation"]["received"] == 4
        assert dinfo["backend"]["kv_page_bytes"] == 256  # the stand-in page really moved
        assert dinfo["mempool"]["tiers"]["host"]["block_bytes"] == 256
        assert dinfo["max_total_num_tokens"] > 400_000  # capacity in pages: the modelled GPU's
        assert dinfo["backend"]["modelled_kv_page_bytes"] == 2 * 1024 * 1024
        assert dinfo["backend"]["verified_pages"] >= len(turn2) // PAGE  # stamps checked
        if caching == "caching-3":
            backs += writes_back(pc2["usage"]["prompt_tokens"], dc2["usage"]["completion_tokens"])
            written_back(d, backs)
            assert info(d)["disaggregation"]["written_back"] == backs
            assert pinfo["backend"]["verified_pages"] > 0  # written-back pages, checked
            assert pinfo["disaggregation"]["written_back_received"] == backs
            metrics = call(p.url + "/metrics")[1]
            assert metric(metrics, "memserve:written_back_cached_tokens_total") >= back > 0
        no_leak(p)
        no_leak(d)


def test_a_chunked_prompt_reports_only_what_its_prefill_found_cached(
    model_dir: Path, tmp_path: Path
) -> None:
    """A prompt prefilled in chunks caches each chunk as it is computed (SGLang's
    cache_unfinished_req); those pages were computed, not reused, and the answer says so."""
    chunk = ("--chunked-prefill-size", str(4 * PAGE))
    with pd_pair(model_dir, tmp_path, "caching-1", *chunk) as (p, d, boot):
        ids = prompt_ids(11, 300)
        pre, dec = pd_generate(p, d, boot, ids)
        assert pre["meta_info"]["cached_tokens"] == 0 == dec["meta_info"]["cached_tokens"]
        again = ids[: 12 * PAGE] + prompt_ids(12, 100)  # 12 pages shared, then new
        pre, dec = pd_generate(p, d, boot, again)
        assert pre["meta_info"]["cached_tokens"] == 12 * PAGE == dec["meta_info"]["cached_tokens"]


ARRIVAL_SKEW_S = 0.01


def test_modelled_transfer_time_delays_the_decode(model_dir: Path, tmp_path: Path) -> None:
    # A slow modelled link (8 Gb/s, 1 GB/s) so that the wire time dominates a long prompt's
    # prefill; at --time-scale 1 the sender sleeps it between allocation and data.
    with pd_pair(model_dir, tmp_path, "basic", "--sim-interconnect-gbps", "8", time_scale="1") as (
        p,
        d,
        boot,
    ):
        model = info(p)["backend"]["latency_model"]
        assert model["interconnect_bytes_per_s"] == 1e9
        page_bytes = info(p)["backend"]["modelled_kv_page_bytes"]

        def wire(tokens: int) -> float:
            pages = -(-tokens // PAGE)
            return model["transfer_latency_s"] + pages * page_bytes / 1e9

        def prefill(tokens: int) -> float:
            pairs = tokens * tokens / 2
            return (
                model["step_overhead_s"]
                + tokens * model["prefill_per_token_s"]
                + pairs * model["prefill_per_token_pair_s"]
            )

        latency = {}
        for seed, n in ((5, 100), (6, 2000)):
            _, dec = pd_generate(p, d, boot, prompt_ids(seed, n), max_new=1)
            latency[n] = dec["meta_info"]["e2e_latency"]
            # both sides get the request at once: the decode's clock may start a little after
            # the prefill's (measured: 40 us short of the sum on a loaded machine)
            assert latency[n] >= prefill(n) + wire(n) - ARRIVAL_SKEW_S
        # the long prompt's first token waits for 125 modelled pages (262 MB) on the wire
        assert latency[2000] - latency[100] >= wire(2000) - wire(100) - prefill(100)
        stats = info(p)["disaggregation"]
        assert stats["modelled_transfer_s"] == pytest.approx(wire(100) + wire(2000), rel=1e-4)
        assert stats["transfer_wall_s"] >= stats["modelled_transfer_s"]
        assert stats["bytes"] == stats["pages_moved"] * 256  # stand-in bytes, not 2 MiB pages
        assert stats["transfer_time"].startswith("modelled")


def kill(server: Server) -> None:
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def test_decode_killed_after_its_claim_fails_the_prefill_clearly(
    model_dir: Path, tmp_path: Path
) -> None:
    # time-scale 30: the 2,000-token prefill computes for about 2.5 s
    with pd_pair(model_dir, tmp_path, timeout="20", time_scale="30") as (p, d, boot):
        body = with_room({"input_ids": prompt_ids(7, 2000), "sampling_params": {}}, boot)
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            pre = pool.submit(call, p.url + "/generate", body)
            dec = pool.submit(call, d.url + "/generate", body)
            wait_for("the claim", lambda: info(p)["disaggregation"]["claimed_rooms"] == 1)
            assert not pre.done()  # still computing
            kill(d)
            status, answer = pre.result()
            elapsed = time.monotonic() - started
            with contextlib.suppress(Exception):
                dec.result()
        assert status == 502, answer
        assert answer["type"] == "KVTransferError"
        assert f"bootstrap_room {body['bootstrap_room']}" in answer["message"]
        assert "sending the KV to decode instance" in answer["message"]
        assert elapsed < 20
        stats = info(p)["disaggregation"]
        assert stats["failures"] == 1 and stats["claimed_rooms"] == 0
        no_leak(p)
        # the prefill keeps serving alone
        alone = {"input_ids": prompt_ids(8, 20), "sampling_params": {"max_new_tokens": 2}}
        assert call(p.url + "/generate", alone)[0] == 200


@pytest.mark.parametrize("when", ["computing", "transferring"])
def test_prefill_killed_after_the_claim_fails_the_decode_clearly(
    model_dir: Path, tmp_path: Path, when: str
) -> None:
    # computing: 2,000 tokens at time-scale 30 keep the prefill busy for 2.5 s;
    # transferring: 20 pages on a 0.1 Gb/s modelled link keep the decode's allocation
    # open for 3.4 s
    extra = ("--sim-interconnect-gbps", "0.1") if when == "transferring" else ()
    scale, n = ("30", 2000) if when == "computing" else ("1", 310)
    with pd_pair(model_dir, tmp_path, "caching-3", *extra, timeout="20", time_scale=scale) as (
        p,
        d,
        boot,
    ):
        body = with_room({"input_ids": prompt_ids(9, n), "sampling_params": {}}, boot)
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            pre = pool.submit(call, p.url + "/generate", body)
            dec = pool.submit(call, d.url + "/generate", body)
            if when == "computing":
                wait_for("the claim", lambda: info(p)["disaggregation"]["claimed_rooms"] == 1)
            else:  # the decode has allocated blocks for the prompt, the data is on its way
                wait_for("the allocation", lambda: used_pages(d)[0] >= -(-n // PAGE))
            assert not dec.done()
            kill(p)
            status, answer = dec.result()
            elapsed = time.monotonic() - started
            with contextlib.suppress(Exception):
                pre.result()
        assert status == 502, answer
        assert "the prefill instance is gone" in answer["message"]
        assert f"bootstrap_room {body['bootstrap_room']}" in answer["message"]
        assert elapsed < 20  # well before the timeout: the decode noticed
        wait_for("the decode's blocks freed", lambda: used_pages(d)[0] == used_pages(d)[1])
        no_leak(d)
        assert info(d)["disaggregation"]["waiting_rooms"] == 0


def start_fails(model_dir: Path, *extra: str) -> str:
    """Run a worker that must refuse to start; its one-line error."""
    args = sim_args(model_dir, *extra)
    cmd = [sys.executable, "-m", "connector.worker", "--port", str(free_port()), *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("worker cannot start:")
    return lines[0]


def test_redis_membership_down_at_start_is_a_one_line_error(model_dir: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    line = start_fails(model_dir, "--disaggregation-mode", "decode", "--cluster-redis", dead)
    assert "unreachable" in line and dead in line


def test_a_full_decode_cache_makes_room_for_incoming_kv(model_dir: Path, tmp_path: Path) -> None:
    """Caching-3 decodes keep every answer; incoming KV must evict that cache, not fail."""
    with pd_pair(model_dir, tmp_path, "caching-3", "--max-total-tokens", "512") as (p, d, boot):
        for seed in range(6):  # 6 x 13 pages through a 32-page decode cache
            ids = [1000 + seed * 300 + i for i in range(200)]
            pd_generate(p, d, boot, ids)
        assert info(d)["disaggregation"]["received"] == 6
        assert info(d)["mempool"]["tiers"]["host"]["blocks"] == 32
        no_leak(d)


@pytest.mark.parametrize("caching", ["caching-1", "caching-3"])
def test_a_prompt_shorter_than_a_page_crosses_a_pair(
    model_dir: Path, tmp_path: Path, caching: str
) -> None:
    """No whole page to insert at the decode, so nothing to pin: the decode used to refuse
    such KV ("inserted but not pinned") and every prompt under 16 tokens failed in PD."""
    with pd_pair(model_dir, tmp_path, caching) as (p, d, boot):
        for n in (1, PAGE - 1, PAGE, PAGE + 1):
            _, answer = pd_generate(p, d, boot, [2000 + i for i in range(n)])
            assert answer["meta_info"]["prompt_tokens"] == n
        # (a caching-3 write-back runs after the decode answered: a loaded machine may still
        # have it on the wire; a leak never settles)
        wait_for("the pair settled", lambda: all(len(set(used_pages(w))) == 1 for w in (p, d)))
        no_leak(p)
        no_leak(d)


def test_a_request_the_router_keeps_from_writing_back_stays_on_the_decode(
    model_dir: Path, tmp_path: Path
) -> None:
    """`memserve.write_back: false` (the router's write-back gate): the caching-3 decode
    keeps the answer's pages in its own cache and sends the prefill nothing, so the next
    turn finds only its prompt there; a malformed field is a 400 on either side."""
    with pd_pair(model_dir, tmp_path, "caching-3") as (p, d, boot):
        turn1 = prompt_ids(21, 300)
        body = {"input_ids": turn1, "sampling_params": {"max_new_tokens": 40}}
        body = with_room({**body, "memserve": {"write_back": False}}, boot)
        (ps, pre1), (ds, dec1) = both(p, d, "/generate", body)
        assert ps == 200 and ds == 200, (pre1, dec1)
        turn2 = turn1 + dec1["output_ids"] + prompt_ids(22, 40)
        wait_for("the decode cached the answer", lambda: used_pages(d)[1] >= 20)
        assert info(d)["disaggregation"]["written_back"] == 0
        assert info(p)["disaggregation"]["written_back_received"] == 0
        pre2, _ = pd_generate(p, d, boot, turn2)
        assert pre2["meta_info"]["cached_tokens"] == len(turn1) // PAGE * PAGE
        assert pre2["meta_info"]["written_back_tokens"] == 0
        written_back(d, 1)  # unmarked, the next request writes back as before

        bad = with_room({**body, "memserve": {"write_back": "no"}}, boot)
        (ps, pb), (ds, db) = both(p, d, "/generate", bad)
        assert ps == 400 and ds == 400, (pb, db)
        assert "'memserve.write_back' must be true or false" in db["message"]
        no_leak(p)
        wait_for("the decode settled", lambda: len(set(used_pages(d))) == 1)


def test_fake_backend_moves_no_kv_and_each_side_computes_alone(
    model_dir: Path, tmp_path: Path, colocated: Server
) -> None:
    extra = ("--disaggregation-transfer-backend", "fake")
    with pd_pair(model_dir, tmp_path, "caching-3", *extra) as (p, d, boot):
        ids = list(range(1000, 1100))
        pre, dec = pd_generate(p, d, boot, ids)
        assert len(pre["output_ids"]) == 1  # the prefill answers its first token only
        assert dec["output_ids"] == colocated_generate(colocated, ids)
        assert info(p)["disaggregation"]["sent"] == info(d)["disaggregation"]["received"] == 0


def test_rdma_asked_for_without_a_device_is_a_one_line_error(model_dir: Path) -> None:
    line = start_fails(model_dir, "--disaggregation-mode", "decode", "--mempool-transport", "rdma")
    assert "no RDMA device" in line  # `auto` would have chosen TCP (the pairs above)


def test_redis_membership_outage_keeps_connected_peers_working(
    model_dir: Path, tmp_path: Path, redis_server: RedisServer, colocated: Server
) -> None:
    member = ("--cluster-redis", redis_server.url)
    with (
        pd_pair(model_dir, tmp_path, "caching-3", *member) as (p, d, boot),
        running(
            "connector.worker",
            sim_args(model_dir, "--disaggregation-mode", "decode", *member),
            tmp_path,
        ) as late,
    ):
        assert info(p)["disaggregation"]["membership"] == redis_server.url
        taken = str(info(p)["disaggregation"]["agent"]["instance_id"])
        line = start_fails(
            model_dir, "--disaggregation-mode", "decode", *member, "--instance-id", taken
        )
        assert f"instance id {taken} is already a live member" in line

        turn1 = prompt_ids(11, 190)
        _, dec1 = pd_generate(p, d, boot, turn1)
        assert writes_back(len(turn1), len(dec1["output_ids"]))
        written_back(d, 1)  # control links both ways now: push and write-back
        kill(Server(redis_server.proc, redis_server.port, tmp_path / "redis.log"))

        started = time.monotonic()
        turn2 = turn1 + dec1["output_ids"] + prompt_ids(12, 36)
        pre2, dec2 = pd_generate(p, d, boot, turn2)
        assert writes_back(len(turn2), len(dec2["output_ids"]))
        assert dec2["output_ids"] == colocated_generate(colocated, turn2)
        expected = EXPECTED_TURN2_CACHED["caching-3"](len(turn1), len(dec1["output_ids"]))
        assert pre2["meta_info"]["cached_tokens"] == expected
        written_back(d, 2)
        assert time.monotonic() - started < 10

        # a decode the prefill never talked to needs a lookup: both sides answer 502 at once
        body = with_room({"input_ids": prompt_ids(13, 50), "sampling_params": {}}, boot)
        started = time.monotonic()
        (ps, pb), (ls, lb) = both(p, late, "/generate", body)
        assert time.monotonic() - started < 10  # the timeout is 20 s
        assert ps == 502 and "membership store" in pb["message"] and "unreachable" in pb["message"]
        assert ls == 502 and "the prefill instance failed bootstrap_room" in lb["message"]
        for worker in (p, d, late):
            assert call(worker.url + "/health")[0] == 200
            no_leak(worker)
